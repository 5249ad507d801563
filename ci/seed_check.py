#!/usr/bin/env python3
"""Run vLLM's `rlhf_http_ipc.py` example unchanged but for its model, and check what it prints.

The example starts `vllm serve` with dummy weights, prints greedy completions, pushes a
Hugging Face model's weights over CUDA IPC through vLLM's own trainer code
(`WeightTransferTrainerFactory.trainer_init` with `IPCTrainerInitInfo`), and prints the
completions again. It only prints; this wrapper holds it to what it claims:

  * the script exits 0;
  * before the sync its completions differ from Hugging Face's greedy text (dummy weights);
  * after the sync every completion equals Hugging Face's greedy text for the same
    weights, dtype (bfloat16) and prompts, computed here on the same GPU. Equal means
    the same string once each side's trailing U+FFFD characters are set aside: vLLM's
    incremental detokenizer holds back a UTF-8 sequence that is not complete yet (and
    so never emits one that a completion ends inside), where a whole decode in Hugging
    Face writes U+FFFD for it (read from vLLM's detokenizer source). Any other
    difference, one character or one replacement character inside the text, fails.

The one change to the script is `MODEL_NAME`, pointed at a local model directory (no hub).
By default that is the harness zoo's OPT with its embedding scaled (`--sharpen`), so that
greedy choices sit far from ties and bfloat16 rounding cannot flip them: the check is
then exact equality, not a tolerance.

    python3 ci/seed_check.py path/to/rlhf_http_ipc.py --out OUT/seed [--model DIR]

Exit status: 0 all checks hold, 1 a check failed, 2 bad input or the script did not run.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def patched(script: str, model_dir: str) -> str:
    new, n = re.subn(r'^MODEL_NAME\s*=\s*.*$', f"MODEL_NAME = {model_dir!r}", script, count=1, flags=re.M)
    if n != 1:
        raise SystemExit("seed_check: the script has no `MODEL_NAME = ...` line to point at a local model")
    return new


def printed_completions(stdout: str, label: str) -> list[tuple[str, str]]:
    """The (prompt, text) pairs the script printed under the heading starting with label."""
    start = stdout.find(label)
    if start < 0:
        return []
    block = stdout[start:]
    nxt = block.find("weight sync", len(label))
    block = block if nxt < 0 else block[: block.rfind("\n", 0, nxt)]
    pairs = re.findall(r"^Prompt: (.*)\nGenerated text: (.*)$", block, flags=re.M)
    return [(ast.literal_eval(p), ast.literal_eval(t)) for p, t in pairs]


def same_text(vllm_text: str, hf_text: str) -> bool:
    """Equal up to trailing U+FFFD, which vLLM's incremental detokenizer holds back."""
    return vllm_text.rstrip("\ufffd") == hf_text.rstrip("\ufffd")


def judge(before: list[tuple[str, str]], after: list[tuple[str, str]], ref: list[str]) -> dict:
    """The checks on what the script printed, given Hugging Face's greedy texts."""
    same_after = [same_text(a, h) for (_, a), h in zip(after, ref)]
    same_before = [same_text(b, h) for (_, b), h in zip(before, ref)]
    return {"gibberish before": {"ok": bool(before) and not all(same_before), "equal_to_hf": same_before},
            "hf greedy after": {"ok": len(after) == len(ref) and all(same_after), "equal_to_hf": same_after}}


def sharpened_opt(dest: Path, factor: float) -> Path:
    """The zoo's OPT with its (tied) embedding scaled by factor: larger logit margins."""
    import torch
    from transformers import AutoModelForCausalLM
    from harness.models import zoo

    src = zoo.model_dir("opt")
    if (dest / "config.json").exists():
        return dest
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(factor)
    model.save_pretrained(dest)
    for f in src.iterdir():  # tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def hf_greedy(model_dir: str, prompts: list[str], max_tokens: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    texts = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids.to("cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("script", type=Path, help="rlhf_http_ipc.py as vLLM ships it")
    ap.add_argument("--out", type=Path, required=True, help="where the patched script, its log and verdict go")
    ap.add_argument("--model", help="a local model directory (default: the sharpened zoo OPT)")
    ap.add_argument("--sharpen", type=float, default=8.0, help="embedding scale of the default model")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the script may run")
    ap.add_argument("--reread", action="store_true",
                    help="judge the verdict.json already in --out again (no GPU, nothing run)")
    args = ap.parse_args(argv)
    if args.reread:
        return reread(args.out / "verdict.json")
    if not args.script.is_file():
        print(f"seed_check: no script at {args.script}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(sharpened_opt(args.out / "model", args.sharpen))
    script = args.out / "rlhf_http_ipc_local.py"
    script.write_text(patched(args.script.read_text(), model))
    t0 = time.monotonic()
    log = args.out / "seed.log"
    try:
        r = subprocess.run([sys.executable, str(script)], text=True, capture_output=True,
                           timeout=args.timeout, start_new_session=True, env=dict(os.environ))
        stdout, stderr, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"timed out after {args.timeout} s", None
    log.write_text(stdout + "\n--- stderr ---\n" + (stderr or ""))
    before = printed_completions(stdout, "BEFORE weight sync")
    after = printed_completions(stdout, "AFTER weight sync")
    verdict: dict = {"script": str(args.script), "model": model, "exit": rc,
                     "seconds": round(time.monotonic() - t0, 1), "checks": {}}
    if rc != 0 or not after:
        verdict["checks"]["script ran"] = {"ok": False, "why": f"exit {rc}; {len(after)} completions after the sync",
                                           "stderr_tail": (stderr or "")[-2000:]}
    else:
        prompts = [p for p, _ in after]
        ref = hf_greedy(model, prompts, max_tokens=32)
        verdict["checks"]["script ran"] = {"ok": True}
        verdict["checks"].update(judge(before, after, ref))
        verdict["completions"] = [{"prompt": p, "before": b, "after": a, "hf": h}
                                  for (p, a), (_, b), h in zip(after, before or [("", "")] * len(after), ref)]
    ok = all(c["ok"] for c in verdict["checks"].values())
    verdict["ok"] = ok
    (args.out / "verdict.json").write_text(json.dumps(verdict, indent=1) + "\n")
    for name, c in verdict["checks"].items():
        print(f"seed_check: {'ok  ' if c['ok'] else 'FAIL'} {name}" + (f": {c.get('why')}" if c.get("why") else ""))
    print(f"seed_check: {'PASSED' if ok else 'FAILED'} ({verdict['seconds']} s; {args.out / 'verdict.json'})")
    return 0 if ok else 1


def reread(path: Path) -> int:
    """Judge a saved verdict's completions again, with this file's rules."""
    verdict = json.loads(path.read_text())
    rows = verdict.get("completions") or []
    if not rows:
        print(f"seed_check: {path} has no completions to judge")
        return 1
    checks = judge([(r["prompt"], r["before"]) for r in rows], [(r["prompt"], r["after"]) for r in rows],
                   [r["hf"] for r in rows])
    ok = verdict["checks"].get("script ran", {}).get("ok", False) and all(c["ok"] for c in checks.values())
    for name, c in checks.items():
        print(f"seed_check: {'ok  ' if c['ok'] else 'FAIL'} {name}: {c['equal_to_hf']}")
    print(f"seed_check: {'PASSED' if ok else 'FAILED'} (judged again from {path})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
