"""The trainer-side adapters against vLLM 0.33's signatures, without vLLM 0.33.

vLLM 0.33 has no CPU build and pins torch 2.14: it cannot be installed here. The
fakes below copy the signatures and checks of its
``vllm/distributed/weight_transfer/base.py`` (``WeightSource.__init_subclass__``
demands a ``functools.cached_property`` ``metadata``; ``iter_full`` / ``iter_local`` /
``owned_names(rank)``; ``TrainerWeightTransferEngine.__init__(*, client, source,
is_sender, rank)``) and ``nccl_engine.py`` (``NCCLWeightTransferUpdateInfo`` lists
default empty; ``trainer_init`` raises without ``iter_full``; ``_sent_meta`` elides
unchanged metadata), as read from the 0.33.0 wheel.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.portable import trainer_api
from harness.trainer.damage import LyingClient
from harness.vllm import api as vllm_api

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------- 0.33 fakes

@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple | None = field(default=None, kw_only=True)


class WeightSource(ABC):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property: "
                            "engines read it repeatedly and it must not change.")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def implements_iter_local(self) -> bool:
        return type(self).iter_local is not WeightSource.iter_local

    def iter_full(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


class TrainerWeightTransferEngine(ABC):
    def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0) -> None:
        self.is_sender, self.rank, self.client, self.source = is_sender, rank, client, source


@dataclass
class NCCLWeightTransferUpdateInfo:
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if len(self.dtype_names) != len(self.names) or len(self.shapes) != len(self.names):
            raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")


class NCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """0.33's send path, without NCCL: the update info it would post."""

    def __init__(self, *, client, source, rank: int = 0) -> None:
        super().__init__(client=client, source=source, rank=rank)
        self._sent_meta: list[ParamMeta] | None = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if not source.implements_iter_full():
            raise TypeError(f"NCCL broadcast sends full tensors, but {type(source).__name__} "
                            "does not implement iter_full().")
        return cls(client=client, source=source, rank=init_info["rank"])

    def send_weights(self) -> list[str]:
        meta = self.source.metadata
        if meta == self._sent_meta:
            info = NCCLWeightTransferUpdateInfo()
        else:
            info = NCCLWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                shapes=[list(m.shape) for m in meta])
        self.client.update_weights(dataclasses.asdict(info))
        sent = [n for n, _ in self.source.iter_full()]
        self._sent_meta = meta
        return sent


@pytest.fixture
def v033(monkeypatch):
    """vllm.distributed.weight_transfer.base replaced by the 0.33 fakes."""
    mod = types.ModuleType("vllm.distributed.weight_transfer.base")
    mod.ParamMeta, mod.WeightSource = ParamMeta, WeightSource
    mod.TrainerWeightTransferEngine = TrainerWeightTransferEngine
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.base", mod)
    monkeypatch.setattr(trainer_api, "_wt", lambda name: {"base": mod}[name])
    return mod


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4, generator=g)),
            ("model.norm.weight", torch.ones(4))]


class _Recorder:
    def __init__(self):
        self.posted: list[dict] = []

    def update_weights(self, info):
        self.posted.append(info)


# ----------------------------------------------------------------------------- tests

def test_a_032_style_source_is_refused_by_033s_base_class(v033):
    """What the adapter must avoid: 0.33 raises at class creation on a metadata()."""
    with pytest.raises(TypeError, match="cached_property"):
        class Old(v033.WeightSource):  # noqa: F841
            def metadata(self):
                return []


@pytest.mark.parametrize("make", [trainer_api.weight_source], ids=["harness-and-script"])
def test_the_source_takes_033s_shape(v033, make):
    weights = _weights()
    source = make(weights)
    assert isinstance(source, v033.WeightSource)
    assert isinstance(type(source).__dict__["metadata"], functools.cached_property)
    assert source.implements_iter_full() and not source.implements_iter_local()
    names = [n for n, _ in weights]
    assert [m.name for m in source.metadata] == names == source.owned_names(0)
    for _ in range(2):  # a fresh pass every round, the very tensors given
        pairs = list(source.iter_full())
        assert [n for n, _ in pairs] == names
        assert all(a is b for (_, a), (_, b) in zip(pairs, weights))
    assert [m.name for m in vllm_api.source_metadata(source)] == names
    assert [n for n, _ in vllm_api.iterate_source(source)] == names
    assert vllm_api.source_style(v033.WeightSource) == "iter_full"


def test_033_nccl_trainer_init_accepts_the_source_and_elides_unchanged_metadata(v033):
    weights, client = _weights(), _Recorder()
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        {"rank": 0}, client=client, source=trainer_api.weight_source([]))
    assert engine.rank == 0
    for _ in range(2):  # the harness swaps in a new source for every round
        engine.source = trainer_api.weight_source(weights)
        assert engine.send_weights() == [n for n, _ in weights]
    assert client.posted[0]["names"] == [n for n, _ in weights]
    assert client.posted[1] == {"names": [], "dtype_names": [], "shapes": []}  # elided
    assert vllm_api.forget_sent_metadata(engine) is True
    engine.send_weights()
    assert client.posted[2]["names"] == [n for n, _ in weights]


def test_a_lie_about_metadata_has_metadata_to_lie_about_under_elision(v033):
    """The trainer calls the NCCL sender's repeat_metadata before a lying round: the
    lie then lands on real names/shapes instead of 'nothing to lie about'."""
    weights, client = _weights(), _Recorder()
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        {"rank": 0}, client=client, source=trainer_api.weight_source(weights))
    engine.send_weights()
    liar = LyingClient(client, "shapes")
    engine.client = liar
    engine.send_weights()
    assert liar.told == ["nothing to lie about (no tensor in this update)"]
    vllm_api.forget_sent_metadata(engine)
    engine.send_weights()
    assert liar.told[-1].startswith("announced model.embed_tokens.weight with shape [9, 4]")
    assert client.posted[-1]["shapes"][0] == [9, 4]


def test_update_info_elision_is_read_from_the_fields():
    assert vllm_api.update_info_elides_metadata(NCCLWeightTransferUpdateInfo) is True
    assert NCCLWeightTransferUpdateInfo().names == []

    @dataclass
    class Info032:
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    assert vllm_api.update_info_elides_metadata(Info032) is False
    assert vllm_api.update_info_elides_metadata(dict) is False


def test_engines_without_elision_are_left_alone():
    class Engine032:
        pass

    e = Engine032()
    assert vllm_api.forget_sent_metadata(e) is False and not hasattr(e, "_sent_meta")


def test_the_nccl_sender_repeats_metadata_through_its_engine(monkeypatch):
    from harness.transfer import nccl

    sender = nccl.Sender.__new__(nccl.Sender)
    sender.vllm = None
    sender.repeat_metadata()  # before the group is open: nothing to forget
    sender.vllm = types.SimpleNamespace(engine=types.SimpleNamespace(_sent_meta=["x"]))
    sender.repeat_metadata()
    assert sender.vllm.engine._sent_meta is None
    sender.vllm.engine = None
    sender.repeat_metadata()  # a static group: no engine


@pytest.mark.slow_unit  # imports the installed vLLM
def test_the_installed_release_is_probed_for_both(monkeypatch):
    pytest.importorskip("vllm")
    from harness.transfer import registry

    caps = registry.probe()
    assert caps["weight_source_style"] in ("iter", "iter_full")
    assert caps["nccl_update_info_elides_metadata"] in (True, False, None)
    from vllm.distributed.weight_transfer.base import WeightSource as Installed

    assert caps["weight_source_style"] == vllm_api.source_style(Installed)
