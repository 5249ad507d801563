"""LoRA adapters as RL uses them: the base weights synced, the adapter swapped by path.

A server started with ``--enable-lora`` (feature ``lora``, harness.run.cases.FEATURES) and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. The seed flow syncs the base weights through
the case's backend (shm on CPU, IPC or NCCL on GPUs); then the trainer saves a PEFT
adapter (harness.trainer.lora: q_proj/v_proj, B drawn nonzero) and loads it through
``POST /v1/load_lora_adapter``. Rollouts that name the adapter as their model must match
Hugging Face with the same adapter applied (peft's PeftModel over the reference model),
within the dtype's tolerance.

The stale-adapter class: a new adapter under a name the server already serves. vLLM
0.32 refuses a plain load of a held name (400, "already been loaded ... set
'load_inplace'"); the trainer then loads in place, and the new adapter must be what is
served, not the old one. Unload, then load again under the same name, is the other way
and is checked too. Both happen with rollouts in flight (bounded: each request has a
timeout, the threads a join deadline): a rollout may be refused with a clear 4xx (the
name is gone after an unload), never a 5xx, a hang or a dead server.

vLLM has no weight-transfer route for adapters (0.26 and 0.32: its weight-transfer
engines move base weights only; docs/cases.md): adapters travel by path on every
backend, and GPU cases (``-k ipc``) run these same tests over an IPC-synced base.
"""

from __future__ import annotations

import threading
import time

import pytest

from harness.trainer import lora
from harness.oracles import parity
from harness.oracles.parity import assert_parity, within_tolerance  # shared with the other test modules

pytest.importorskip("peft", reason="the LoRA tests write adapters with peft: pip install "
                    "'weight-sync-harness[lora]' (or pip install peft)")

pytestmark = [pytest.mark.parity, pytest.mark.features("lora"), pytest.mark.models("llama"),
              pytest.mark.dtypes("float32")]

SEEDS = {"a": 3101, "b": 3102, "c": 3103, "d": 3104, "e": 3105}
NAME = "policy"
INFLIGHT_THREADS = 2
INFLIGHT_REQUEST_S = 60.0      # one rollout's timeout
INFLIGHT_JOIN_S = 120.0        # the rollout threads must be done this long after the swap
INFLIGHT_MAX_REQUESTS = 200    # per thread: a bound, should the stop never come


def adapter(s, key: str):
    """(adapter directory, Hugging Face reference of base + adapter) for SEEDS[key]."""
    path = lora.write_adapter(s.model_path, SEEDS[key])
    return path, s.reference(adapter=path)


def must_load(s, name, path, **kw) -> str:
    status, text = lora.load(s.client, name, path, **kw)
    assert status == 200, (f"POST {lora.LOAD_ROUTE} {name} {path}{' ' + str(kw) if kw else ''}: "
                           f"{status} {text}\n{s.client.context()}")
    return text


def assert_serves(s, client, new_ref, old_ref, what: str) -> parity.ParityReport:
    """The adapter client computes ``new_ref`` (within tolerance), and not ``old_ref``:
    an adapter swap that kept the old adapter fails here."""
    report = s.compare(new_ref, client)
    if old_ref is not None:
        old = s.compare(old_ref, client)
        if within_tolerance(old):
            raise AssertionError(f"{what}: the server still serves the previous adapter "
                                 f"({old.summary()}; vs the new one: {report.summary()})")
    assert_parity(report, decode=s.decode, what=what)
    return report


class InFlight:
    """Rollouts naming ``name`` in threads, until stopped: what each one got."""

    def __init__(self, client, name: str, prompt_ids: list[int]):
        self.client, self.name, self.prompt_ids = client, name, prompt_ids
        self.stop = threading.Event()
        self.outcomes: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True, name=f"rollout-{i}")
                        for i in range(INFLIGHT_THREADS)]

    def _run(self) -> None:
        c = lora.adapter_client(self.client, self.name)
        for _ in range(INFLIGHT_MAX_REQUESTS):
            if self.stop.is_set():
                return
            body = {"model": self.name, "prompt": self.prompt_ids, "max_tokens": 8,
                    "temperature": 0.0}
            try:
                r = c.raw("POST", "/v1/completions", json=body, timeout=INFLIGHT_REQUEST_S)
                got = str(r.status_code) if r.status_code != 200 else "200"
                if r.status_code != 200:
                    got += f" {r.text[:200]}"
            except Exception as e:  # a timeout or a dropped connection: reported, not raised
                got = f"{type(e).__name__}: {e}"
            with self._lock:
                self.outcomes.append(got)

    def __enter__(self) -> "InFlight":
        for t in self.threads:
            t.start()
        # at least one rollout answered before the swap starts: they are really in flight
        deadline = time.monotonic() + INFLIGHT_REQUEST_S
        while not self.outcomes and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(INFLIGHT_JOIN_S)
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive and exc[0] is None:
            raise AssertionError(f"rollouts still running {INFLIGHT_JOIN_S:.0f}s after the swap: "
                                 f"{alive}")

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            key = o if o == "200" else o.split(" ")[0]
            out[key] = out.get(key, 0) + 1
        return out

    def assert_clean(self, allowed: tuple[str, ...], what: str) -> None:
        bad = [o for o in self.outcomes if o.split(" ")[0] not in allowed]
        if bad:
            raise AssertionError(f"{what}: {len(bad)} of {len(self.outcomes)} rollouts in flight "
                                 f"got other than {'/'.join(allowed)}; first: {bad[0]}")


def test_lora_adapter_matches_hf(synced, session):
    """The base synced, one adapter loaded by path: rollouts naming it match Hugging Face
    with the adapter applied; the base model still matches the base."""
    s = session
    s.ensure_holds()
    path, ref = adapter(s, "a")
    name = f"{NAME}-parity"
    try:
        must_load(s, name, path)
        listed = [m["id"] for m in s.client._call("GET", "/v1/models")["data"]]
        assert name in listed, f"/v1/models after the load lists {listed}"
        client = lora.adapter_client(s.client, name)
        # the adapter must change the outputs, or matching the base would pass too
        report = assert_serves(s, client, ref, synced.reference,
                               "rollouts naming the adapter vs Hugging Face + PeftModel")
        base = s.compare(synced.reference)
        s.record(lora_max_abs_dlogprob=report.max_abs, lora_topk_max_abs=report.topk_max_abs,
                 lora_greedy_identical=sum(report.greedy_identical),
                 base_after_load_max_abs_dlogprob=base.max_abs)
        assert_parity(base, decode=s.decode, what="the base model with an adapter loaded")
    finally:
        lora.unload(s.client, name)


def test_lora_same_name_swap_with_rollouts_in_flight(synced, session):
    """A new adapter under the name the server serves, with rollouts in flight: in place
    (vLLM refuses a plain load of a held name), then unload and load again. After each,
    the newest adapter is served."""
    s = session
    s.ensure_holds()
    (pa, ra), (pb, rb), (pc, rc) = adapter(s, "a"), adapter(s, "b"), adapter(s, "c")
    facts: dict = {}
    must_load(s, NAME, pa)
    client = lora.adapter_client(s.client, NAME)
    try:
        assert_serves(s, client, ra, synced.reference, "adapter a")
        prompt = ra.prompts[0].prompt_ids
        with InFlight(s.client, NAME, prompt) as flight:
            status, text = lora.load(s.client, NAME, pb)   # what a trainer tries first
            facts["plain_load_of_held_name"] = {"status": status, "answer": text[:300]}
            if status != 200:
                assert status == 400 and "already" in text, (
                    f"a plain load of a held name: expected 200 or a clear 400, got {status} "
                    f"{text}")
                assert "load_inplace" in lora.load_fields(s.client), (
                    f"the server refused a held name ({text}) and offers no load_inplace")
                must_load(s, NAME, pb, load_inplace=True)
                facts["swap"] = "load_inplace"
            else:
                facts["swap"] = "plain load replaced it"
        facts["inflight_during_inplace_swap"] = flight.summary()
        s.record(lora_swap=facts)
        flight.assert_clean(("200",), "in-place swap")
        assert_serves(s, client, rb, ra, "after the in-place swap to adapter b")

        with InFlight(s.client, NAME, prompt) as flight:
            status, text = lora.unload(s.client, NAME)
            assert status == 200, f"unload: {status} {text}"
            # rollouts after the unload and before the next load: refused by name
            gone = s.client.raw("POST", "/v1/completions", timeout=INFLIGHT_REQUEST_S,
                                json={"model": NAME, "prompt": prompt, "max_tokens": 1})
            facts["request_after_unload"] = {"status": gone.status_code,
                                             "answer": gone.text[:300]}
            must_load(s, NAME, pc)
        facts["inflight_during_unload_load"] = flight.summary()
        s.record(lora_swap=facts)
        assert gone.status_code == 404, (f"a rollout naming an unloaded adapter: expected 404, "
                                         f"got {gone.status_code} {gone.text[:300]}")
        flight.assert_clean(("200", "404"), "unload then load")
        assert_serves(s, client, rc, rb, "after unload and a load of adapter c under the name")
        assert_parity(s.compare(synced.reference), decode=s.decode,
                      what="the base model after the swaps")
    finally:
        lora.unload(s.client, NAME)


@pytest.mark.selftest
def test_lora_selftest_stale_adapter_is_seen(synced, session):
    """The swap check must fail when the swap keeps the old adapter: "swap" to b by
    reloading a's directory in place, then check for b."""
    s = session
    s.ensure_holds()
    (pa, ra), (pb, rb) = adapter(s, "a"), adapter(s, "b")
    name = f"{NAME}-selftest"
    must_load(s, name, pa)
    try:
        must_load(s, name, pa, load_inplace=True)   # the broken swap: the old adapter again
        with pytest.raises(AssertionError, match="still serves the previous adapter"):
            assert_serves(s, lora.adapter_client(s.client, name), rb, ra, "stale swap")
    finally:
        lora.unload(s.client, name)


# Longer than two CPU KV blocks (128 tokens each; 16 on GPU): the prefix cache keeps
# full blocks only, and only completions read it (prompt-logprob requests skip it).
LONG_PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital "
               "of Italy is Rome. Water boils at one hundred degrees. The quick brown fox "
               "jumps over the lazy dog. The sun rises in the east and sets in the west. She "
               "said hello to the world, and the world said hello back. ") * 4
LONG_MIN_TOKENS = 2 * 128 + 1
CONTROL_PROMPT = "Once" + LONG_PROMPT.strip()[len("The"):]


def test_lora_inplace_reload_from_the_same_path(synced, session, tmp_path):
    """A trainer that saves every step's adapter into one directory and reloads it in
    place: a long prompt sent before the reload and repeated after it (the prefix cache
    can serve the repeat) must be computed with the new adapter."""
    import shutil

    s = session
    s.ensure_holds()
    (pa, _), (pb, rb) = adapter(s, "a"), adapter(s, "b")
    long_a = s.reference(adapter=pa, prompts=(LONG_PROMPT.strip(),), max_tokens=8)
    long_b = s.reference(adapter=pb, prompts=(LONG_PROMPT.strip(),), max_tokens=8)
    n = len(long_a.prompts[0].prompt_ids)
    assert n >= LONG_MIN_TOKENS, f"the long prompt is {n} tokens; it must span two KV blocks"
    step_dir = tmp_path / "adapter"
    shutil.copytree(pa, step_dir)
    name = f"{NAME}-samepath"
    must_load(s, name, step_dir)
    client = lora.adapter_client(s.client, name)
    try:
        from harness.run import flow

        before = parity.compare_generation(flow.observe_generation(client, long_a), long_a,
                                           decode=s.decode)  # fills the prefix cache
        parity.assert_logprobs_close(before, decode=s.decode)
        shutil.rmtree(step_dir)
        shutil.copytree(pb, step_dir)                  # the next step's adapter, same path
        must_load(s, name, step_dir, load_inplace=True)
        assert_serves(s, client, rb, None, "after the in-place reload (prompt logprobs: no cache)")
        # control: a long prompt never sent before (another first token: other block
        # hashes) is computed with the new adapter, so a difference below is the cache's
        fresh = s.reference(adapter=pb, prompts=(CONTROL_PROMPT,), max_tokens=8)
        control = parity.compare_generation(flow.observe_generation(client, fresh), fresh,
                                            decode=s.decode)
        after = parity.compare_generation(flow.observe_generation(client, long_b), long_b,
                                          decode=s.decode)
        s.record(samepath_after_max_abs_dlogprob=after.max_abs,
                 samepath_after_greedy_match=after.greedy_match_fraction,
                 samepath_control_max_abs_dlogprob=control.max_abs,
                 samepath_prefix_cache_stale=not within_tolerance(after))
        parity.assert_logprobs_close(control, decode=s.decode)
        parity.assert_greedy_equal(control)
        if not (within_tolerance(after) and after.greedy_match_fraction == 1.0):
            raise AssertionError(
                "after an in-place reload from the same path, a prompt sent before it is served "
                "from prefix-cache blocks of the previous adapter (a prompt never sent is "
                f"computed with the new one: {control.summary()}): {after.summary()}")
    finally:
        lora.unload(s.client, name)


# ----------------------------------------------------------------------------- issue 58
# LoRA eviction (docs/vllm-rl-matrix.md row 63). The lora feature's server has two slots
# (--max-loras 2; --max-cpu-loras defaults to it, vllm/config/lora.py): a third adapter
# loaded or served evicts the least recently used one from the worker's cache
# (LRUCacheWorkerLoRAManager.add_adapter), and serving an evicted adapter reads it from
# its path again. SkyRL #2250 saw an adapter reloaded after eviction scaled twice; peft's
# reference applies the scaling once, so a double scaling fails parity.
EVICTION_ORDER = "abcab"   # with two slots, every use from the third on is a reload


def test_lora_evicted_adapters_come_back_with_their_own_weights_scaled_once(synced, session):
    """Three adapters on two slots, served in turn a, b, c, a, b: each use evicts one,
    and each adapter, reloaded, must match Hugging Face with its own adapter (scaled
    once), not the one that held its slot; then an in-place swap of an evicted name
    (a -> d) must serve d once it is used again."""
    s = session
    s.ensure_holds()
    ads = {k: adapter(s, k) for k in "abcd"}
    names = {k: f"{NAME}-evict-{k}" for k in "abc"}
    served: list[dict] = []
    try:
        for k in "abc":
            must_load(s, names[k], ads[k][0])
        previous = None
        for k in EVICTION_ORDER:
            client = lora.adapter_client(s.client, names[k])
            r = assert_serves(s, client, ads[k][1], ads[previous][1] if previous else None,
                              f"adapter {k}, served after {previous or 'nothing'} on two slots "
                              f"(order {EVICTION_ORDER})")
            served.append({"adapter": k, "max_abs_dlogprob": r.max_abs})
            previous = k
        s.record(lora_eviction=served)
        # the cache holds a and b now; serving c evicts a, which is then swapped in place
        # (a -> d) while out of the cache; b evicts c, and a must come back as d
        assert_serves(s, lora.adapter_client(s.client, names["c"]), ads["c"][1], None,
                      "adapter c, evicting a")
        must_load(s, names["a"], ads["d"][0], load_inplace=True)
        assert_serves(s, lora.adapter_client(s.client, names["b"]), ads["b"][1], None,
                      "adapter b after an in-place swap of another name")
        r = assert_serves(s, lora.adapter_client(s.client, names["a"]), ads["d"][1],
                          ads["a"][1], "the name swapped in place to adapter d while evicted")
        s.record(lora_eviction=served, inplace_swap_under_eviction_max_abs=r.max_abs)
        assert_parity(s.compare(synced.reference), decode=s.decode,
                      what="the base model after the evictions")
    finally:
        for k in "abc":
            lora.unload(s.client, names[k])


def test_lora_an_adapter_loaded_in_place_is_not_read_from_disk_again(synced, session,
                                                                     tmp_path):
    """SkyRL #1606: an adapter loaded in place must be read from its path at the load,
    not at every request. Loaded in place from a directory, served, then the directory
    rewritten with another adapter and no load: it must still serve what was loaded
    (vLLM 0.32 keeps ``load_inplace`` on the stored request, and its worker loads an
    adapter whose request says so again at every step: known issue
    lora-inplace-rereads-from-disk)."""
    import shutil

    s = session
    s.ensure_holds()
    (pa, ra), (pd, rd), (pe, re_) = adapter(s, "a"), adapter(s, "d"), adapter(s, "e")
    step_dir = tmp_path / "adapter"
    shutil.copytree(pa, step_dir)
    name = f"{NAME}-reread"
    must_load(s, name, step_dir)
    client = lora.adapter_client(s.client, name)
    try:
        assert_serves(s, client, ra, None, "adapter a, loaded")
        shutil.rmtree(step_dir)
        shutil.copytree(pd, step_dir)
        must_load(s, name, step_dir, load_inplace=True)
        assert_serves(s, client, rd, ra, "adapter d, loaded in place from the same path")
        shutil.rmtree(step_dir)
        shutil.copytree(pe, step_dir)   # the trainer writes its next step; nobody loads it
        now = s.compare(rd, client)
        rewritten = s.compare(re_, client)
        s.record(reread_vs_loaded_max_abs=now.max_abs, reread_vs_rewritten_max_abs=rewritten.max_abs)
        assert not within_tolerance(rewritten), (
            "an adapter loaded in place serves what its directory holds now, not what was "
            f"loaded: it is read from disk again on a request ({rewritten.summary()})")
        assert_parity(now, decode=s.decode, what="the adapter loaded in place, after its "
                                                 "directory was rewritten without a load")
    finally:
        lora.unload(s.client, name)


@pytest.mark.selftest
def test_lora_selftest_eviction_check_sees_the_adapter_that_held_the_slot(synced, session):
    """The eviction check must fail when an adapter serves the weights of the one that
    held its slot before: the name of b loaded with a's weights (what a reload that
    read the wrong slot would serve), then checked for b."""
    s = session
    s.ensure_holds()
    (pa, ra), (pb, rb) = adapter(s, "a"), adapter(s, "b")
    name = f"{NAME}-evict-selftest"
    must_load(s, name, pa)
    try:
        with pytest.raises(AssertionError, match="still serves the previous adapter"):
            assert_serves(s, lora.adapter_client(s.client, name), rb, ra,
                          "adapter b served after a on a slot")
    finally:
        lora.unload(s.client, name)

