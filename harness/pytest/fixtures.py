"""The fixtures the plugin gives tests: ``server_pool``, ``session`` (a test's
``SyncSession``), ``synced`` (the seed flow, run once per case and shared), and
``harness`` (``session``'s old name)."""

from __future__ import annotations

import dataclasses
import time
import unittest
import warnings

import pytest

from harness.models import ModelUnavailable
from harness.pytest.run_state import SESSION, STATE, settings_of
from harness.pytest.servers import start_pool
from harness.run.cases import Case
from harness.run.flow import FlowResult, SyncSession, seed_flow
from harness.run.pool import NeedsFreshServer, ServerPool, ServerUnavailable
from harness.vllm.server import ServerError


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest) -> ServerPool:
    """The session's servers: planned from the selected tests and started before the
    first test (``pytest_runtestloop``), each stopped after the last test that needs it."""
    state = request.config.stash[STATE]
    return state.pool or start_pool(request.config, state)


def open_session(request: pytest.FixtureRequest, case: Case, pool: ServerPool, *,
             fresh: bool) -> SyncSession:
    s = settings_of(request.config)
    node = request.node
    node.user_properties.append(("case", case.as_dict()))
    t0 = time.monotonic()
    try:
        sess = SyncSession(case, pool, fresh=fresh, sync_timeout=s.vllm_sync_timeout,
                           attention_backend=s.vllm_attention_backend, api_key=s.vllm_api_key,
                           on_record=lambda kind, data: node.user_properties.append((kind, data)),
                           user=node.nodeid)
    except (NeedsFreshServer, ModelUnavailable) as e:
        pytest.skip(str(e).splitlines()[0])
    except (ServerUnavailable, ServerError) as e:
        pytest.fail(str(e), pytrace=False)
    sess.record(server_wait_seconds=round(time.monotonic() - t0, 3))
    node.stash[SESSION] = sess
    return sess


@pytest.fixture
def session(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool):
    """A ``SyncSession`` for this test's case: server, client, reference, sync()."""
    sess = open_session(request, case, server_pool,
                    fresh=request.node.get_closest_marker("fresh_server") is not None)
    yield sess
    if sess.client.sleep_retries:  # a sleep raced another process's allocation (client.sleep)
        sess.record(sleep_retries=sess.client.sleep_retries)
    restarted = sess.leave_healthy()
    if restarted:
        warnings.warn(restarted, stacklevel=2)
    # A server that died during this test is not restarted: later tests on it fail
    # with this cause and its log tail, not with connection errors.
    died = sess.pool.mark_dead(sess.server_cfg, during=request.node.nodeid)
    if died:
        warnings.warn(died.splitlines()[0], stacklevel=2)


@pytest.fixture
def harness(session: SyncSession) -> SyncSession:
    """Deprecated: the same ``SyncSession`` as ``session``, under the name it had
    before, which inside a test hides the ``harness`` package. Use ``session``."""
    return session


@dataclasses.dataclass
class SyncOutcome:
    """The seed flow of one case, shared by the tests that assert on it."""

    case: Case
    flow: FlowResult
    session: SyncSession

    @property
    def reference(self):
        return self.flow.reference

    @property
    def before(self):
        return self.flow.before

    @property
    def after(self):
        return self.flow.after

    @property
    def trainer(self) -> dict:
        return self.flow.sync


@pytest.fixture
def synced(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool) -> SyncOutcome:
    """The seed flow, run once per case on a never-synced server and shared."""
    outcomes = request.config.stash[STATE].outcomes
    got = outcomes.get(case.id)
    if isinstance(got, unittest.SkipTest):  # e.g. trainer code this release cannot run
        pytest.skip(str(got).splitlines()[0])
    if isinstance(got, BaseException):
        pytest.fail(f"the shared sync for {case.id} failed earlier: {got}", pytrace=False)
    if got is None:
        sess = open_session(request, case, server_pool, fresh=True)
        try:
            got = outcomes[case.id] = SyncOutcome(case, seed_flow(sess), sess)
        except BaseException as e:
            outcomes[case.id] = e
            raise
    else:
        request.node.user_properties.append(("case", case.as_dict()))
        request.node.user_properties.append(("metrics", dict(got.session.metrics)))
        got.session.on_record = (lambda kind, data, node=request.node:
                                 node.user_properties.append((kind, data)))
        got.session.user = request.node.nodeid
        request.node.stash[SESSION] = got.session
    return got
