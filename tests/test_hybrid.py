"""A Mamba/attention hybrid (zoo model ``nemotron-h``): weight sync into state-space layers.

Hybrid models hold tensors no attention model has: the Mamba2 mixer's ``A_log`` (vLLM
keeps ``A = -exp(A_log)``, computed at load), ``D``, ``dt_bias`` and the depthwise
``conv1d`` weight (3-D on disk, 2-D in vLLM). Reloads have broken exactly these, so each
is checked on its own here: a sync must carry it (the server then computes what Hugging
Face computes with it), and a sync that leaves it out must be seen. The server should
also keep the old value of what was left out; vLLM's layerwise reload does not (known
issue partial-layer-update-uninitialized-ssm). Seed flow and parity are in
test_parity.py (the hybrid is one of its ARCHITECTURES), the disk-loaded twin too (full
depth: a second server).

One server (shm-cpu-fp32-nemotron-h) serves every test here and the seed flow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from harness.oracles.parity import NonFiniteOutput, assert_parity, within_tolerance

pytestmark = [pytest.mark.parity, pytest.mark.models("nemotron-h"), pytest.mark.dtypes("float32")]

REPEAT_SEEDS = (2101, 2102)
# The Mamba2 mixer's tensors: on disk under the checkpoint's names, sent (and left out)
# under the trainer's in-memory names (transformers 5 maps backbone. to model.)
MIXER = "backbone.layers.0.mixer."
SENT_MIXER = "model.layers.0.mixer."
# Each state-space tensor and a change that moves the outputs by whole nats: the zoo
# draws them small (std 0.02), so a perturbation of a few percent would be lost in the
# tolerance and a stale value could hide.
SSM_SHIFTS = {
    "A_log": lambda t: t + 1.5,          # A = -exp(A_log): a 4.5x faster decay
    "D": lambda t: t + 1.0,              # the skip connection
    "dt_bias": lambda t: t + 2.0,        # softplus(dt + dt_bias): the step size
    "conv1d.weight": lambda t: -t,       # the depthwise causal convolution
}


def shifted_copy(src: Path, dest: Path, names: list[str]) -> Path:
    """A copy of the model in ``src`` whose tensors ``names`` (suffixes of SSM_SHIFTS
    after MIXER) are shifted; everything else identical."""
    if (dest / "harness-model.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            for n in names:
                full = MIXER + n
                assert full in tensors, f"{full} is not a tensor of {src.name}"
                tensors[full] = SSM_SHIFTS[n](tensors[full]).contiguous()
            save_file(tensors, dest / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dest / f.name)
    (dest / "harness-model.json").write_text(json.dumps({"shifted_from": str(src),
                                                          "tensors": names}))
    return dest


def test_hybrid_repeated_syncs_last_one_wins(session, tmp_path_factory):
    """A -> B -> A on the hybrid (tests/test_parity.py's ``a_then_b_then_a``): weights A
    (seed 2101), B (seed 2102 with every state-space tensor shifted by SSM_SHIFTS), then
    A again; after each, parity with that step's reference and none with the other's,
    and where /weight_checker exists, A again gives A's digests back. B's state-space
    tensors are far from A's, so a Mamba2 tensor or buffer that keeps one update's value
    at the next is off by whole nats, not by the perturbation's few 1e-3 (seen: B with
    A's A_log left in fails step 2)."""
    from test_parity import a_then_b_then_a  # tests/ is on sys.path (rootdir-relative import)

    a, b = (session.perturbed(seed) for seed in REPEAT_SEEDS)
    b = shifted_copy(b, tmp_path_factory.mktemp("ssm-shifted-b") / "b", list(SSM_SHIFTS))
    a_then_b_then_a(session, a, b)


@pytest.mark.selftest
def test_hybrid_ssm_tensors_synced_and_left_out_seen(session, tmp_path_factory):
    """Every state-space tensor, one at a time: the server first takes weights whose SSM
    tensors are all shifted (it must then compute exactly what Hugging Face computes with
    them: each one was loaded, A_log through its -exp), then a sync of the model that
    leaves out one of them must leave exactly that one shifted: parity with a reference
    where only it is shifted, and none with the model's."""
    s = session
    src = Path(s.model_path)
    root = tmp_path_factory.mktemp("ssm-shifted")
    names = list(SSM_SHIFTS)
    all_shifted = shifted_copy(src, root / "all", names)
    ref_model = s.reference()
    s.sync(all_shifted)
    report = s.compare(s.reference(all_shifted))
    facts = {"all_shifted_max_abs_dlogprob": report.max_abs}
    s.record(ssm=facts)
    assert_parity(report, decode=s.decode,
                  what=f"after a sync of the model with {', '.join(names)} shifted")
    not_kept = {}
    for n in names:
        target = SENT_MIXER + n
        result = s.sync(corrupt="drop", corrupt_target=target)
        assert result.get("corruption") == f"dropped {target}", result
        stale = _compare(s, ref_model)
        kept = _compare(s, s.reference(shifted_copy(src, root / n.replace(".", "_"), [n])))
        facts[n] = {"kept": kept if isinstance(kept, str) else kept.max_abs,
                    "vs_model": stale if isinstance(stale, str) else stale.max_abs}
        s.record(ssm=facts)
        # The check that must hold: a sync that misses the tensor is seen.
        assert isinstance(stale, str) or not within_tolerance(stale), (
            f"a sync without {target} still matches the model's reference ({stale.summary()}): "
            "leaving it out went unseen")
        if isinstance(kept, str) or not within_tolerance(kept):
            not_kept[target] = kept if isinstance(kept, str) else kept.summary()
        # Back to all-shifted, so that the next tensor left out is again the only one
        s.sync(all_shifted)
    # Asserted after the loop, so that every tensor's left-out check has run first.
    assert not not_kept, (
        "a sync that leaves one state-space tensor out did not keep its old value "
        "(parity with a reference where only that tensor is shifted): "
        + "; ".join(f"{t}: {why}" for t, why in not_kept.items()))


def _compare(s, reference):
    """The parity report against ``reference``, or a line saying the server's logprobs
    were NaN/inf (which matches no reference)."""
    try:
        return s.compare(reference)
    except NonFiniteOutput as e:
        return str(e).splitlines()[0]
