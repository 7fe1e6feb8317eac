"""``voice-mstar`` served through M*'s real ``Engine`` (``workloads.harness.mstar_serving``): Orpheus's LLM node and
its SNAC decoder node (tiny random weights, both loaded by M*'s own loaders from local folders), reuse off (M*'s
``KVManager``) vs on (mmcache's ``ReuseKVManager``), 1 and 4 requests in flight on the same ``closed:N`` schedule.
Only flashinfer's and triton's kernels are stand-ins (``workloads.peers.mstar_cpu_kernels``).

- the generated code ids are equal off vs on for every request, and so is the audio (both runs make the same
  batches step for step);
- with reuse on the prefills compute fewer prompt tokens (users of one voice share its reference, a session's turn
  re-sends the turn before it);
- every request has its first audio after its first token (the decoder needs a 28-code window), and audio at all;
- the reference's code tokens map back to the codes through M*'s own ``SNACDecoderSubmodule`` mapping.
"""

import pytest
import torch

from mstar_helpers import require_mstar

require_mstar()
from workloads.harness.mstar_serving import compare_mstar  # noqa: E402
from workloads.harness.serving import Schedule  # noqa: E402
from workloads.models import voice_mstar  # noqa: E402
from workloads.options import ModelWorkloadOptions  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    # 5 requests in arrival order: two users of voice 0, a session's first two turns in voice 0, one user of voice 1
    return voice_mstar.factory(ModelWorkloadOptions(model_dir=tmp_path_factory.mktemp("orpheus"), limit=5,
                                                    max_new_tokens=5))


@pytest.mark.parametrize("n", [1, 4])
def test_reuse_on_and_off_generate_the_same_codes_and_audio_and_on_computes_less(made, n):
    off, on, equal = compare_mstar(made, Schedule("closed", concurrency=n), n)
    assert equal == len(off.records) == len(on.records) == 5
    assert f"via {voice_mstar.ENGINE}, {n} in flight" in on.schedule
    assert on.computed_tokens < off.computed_tokens and all(r.result.hit_tokens == 0 for r in off.records)
    assert any(r.result.hit_tokens for r in on.records if r.rid == "voice/t1")  # the turn before it, codes included
    for run in (off, on):
        for r in run.records:
            assert r.audio_s and r.ttfa_s >= r.ttft_s, r
            assert r.result.output_tokens == 5 * 7


def test_the_audio_is_equal_off_and_on_under_the_same_batches(made):
    a, b = made(), made()
    from workloads.harness.mstar_serving import serve_mstar_run
    schedule = Schedule("closed", concurrency=4)
    serve_mstar_run(a, schedule, False, 4)
    serve_mstar_run(b, schedule, True, 4)
    assert a.audio.keys() == b.audio.keys()
    for rid, chunks in a.audio.items():
        assert len(chunks) == 3  # windows at 28 and 35 codes, then the flush of the last 21
        assert all(torch.equal(x, y) for x, y in zip(chunks, b.audio[rid], strict=True))


def test_reference_code_tokens_map_back_through_m_star_s_snac_node(made):
    from mstar.model.orpheus.submodules import SNACDecoderSubmodule
    g = torch.Generator().manual_seed(0)
    c0, c1, c2 = (torch.randint(0, voice_mstar.CODEBOOK, (k * 3,), generator=g) for k in (1, 2, 4))
    tokens = torch.tensor(voice_mstar.frames_to_tokens(c0, c1, c2) + [0] * 7)  # 4 frames: one window
    node = SNACDecoderSubmodule.__new__(SNACDecoderSubmodule)
    torch.nn.Module.__init__(node)
    node.config, node.idx_14, node.idx_2356 = made.cfg, torch.tensor([1, 4]), torch.tensor([2, 3, 5, 6])
    got = node._extract_snac_codes(node._tokens_to_codes(tokens))
    assert torch.equal(got[0].flatten()[:3], c0)
    assert torch.equal(got[1].flatten()[:6], c1) and torch.equal(got[2].flatten()[:12], c2)
