"""Model-backed workloads on tiny random-weight models: vlm-chat (tiny LLaVA, images in the page chain, an encoder
store), agent-model (tiny Llama) and their blend, served with the cache off and on through ``serving.compare``.

Every test compares the generated tokens of the two runs request by request: reuse must be exact across the whole
workload, follow-ups included (they re-send the previous turn's generated reply, so a wrong token would propagate).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcache.errors import TraceError
from workloads.harness.metrics import summarize
from workloads.harness.serving import Schedule, compare
from workloads.models import agent, vlm_chat
from workloads.models.mixed import Mixed
from workloads.options import ModelWorkloadOptions

NEW = 4  # tokens generated per request


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def options(model_dir, **kw) -> ModelWorkloadOptions:
    return ModelWorkloadOptions(model_dir=model_dir, max_new_tokens=NEW, **kw)


def compare_keeping(factory, schedule=Schedule()):
    """``compare`` that also returns the two workloads it built (to read their ``outputs``)."""
    made = []

    def make():
        made.append(factory())
        return made[-1]

    return (*compare(make, schedule), *made)


def assert_exact(off, on, wl_off, wl_on):
    """Same requests completed, same prompt sizes, same generated tokens, with the cache off and on."""
    assert [r.rid for r in off.completed] == [r.rid for r in on.completed]
    assert [r.result.prompt_tokens for r in off.completed] == [r.result.prompt_tokens for r in on.completed]
    assert wl_off.outputs == wl_on.outputs and len(wl_on.outputs) == len(on.completed)
    assert all(len(out) == NEW for out in wl_on.outputs.values())


# ------------------------------------------------------------------------------------------------------- vlm-chat
@pytest.fixture(scope="module")
def vlm_runs(model_dir):
    """The embedded default's first 12 requests: image 0 asked by 3 users (3 turns each), then image 1's first user."""
    return compare_keeping(vlm_chat.factory(options(model_dir, limit=12)))


def test_vlm_chat_embedded_default_off_and_on(vlm_runs):
    off, on, *_ = vlm_runs
    a, b = summarize(off), summarize(on)
    assert a["completed"] == b["completed"] == 12 and a["failed"] == b["failed"] == 0
    assert a["hit_rate"] == {"prefix": 0.0, "image": 0.0}
    assert b["hit_rate"]["prefix"] > 0.5 and b["hit_rate"]["image"] > 0.5
    assert b["of_ceiling"] == pytest.approx({"prefix": 1.0, "image": 1.0})  # the pool never evicts here
    for run in (off, on):
        assert all(len(r.token_s) == NEW and r.ttft_s is not None for r in run.records)
        assert {"image", "prefill"} <= set(summarize(run)["stages_s"])
    assert off.cache_stats["prefix"]["queries"] == 0 and off.cache_stats["encoder"]["by_modality"] == {}


def test_vlm_chat_cache_on_hits_the_encoder_store_and_the_prefix(vlm_runs):
    _, on, _, wl = vlm_runs
    image = on.cache_stats["encoder"]["by_modality"]["image"]
    assert image["hits"] == 2 and image["misses"] == 2  # users 2 and 3 of image 0 hit; images 0 and 1 miss once
    by_rid = {r.rid: r.result for r in on.records}
    follow_ups = [rid for rid in by_rid if not rid.endswith("t0")]
    assert len(follow_ups) == 8
    for rid in follow_ups:  # every full page of the previous prompt (images included) is matched
        before = by_rid[rid[:-1] + str(int(rid[-1]) - 1)]
        assert by_rid[rid].hit_tokens == before.prompt_tokens // wl.page_size * wl.page_size
        assert by_rid[rid].encoder_hits == {"image": 1}
    assert by_rid["i0u0t0"].hit_tokens == 0 and by_rid["i0u0t0"].encoder_hits == {"image": 0}
    assert by_rid["i0u1t0"].hit_tokens > 0 and by_rid["i0u1t0"].encoder_hits == {"image": 1}


def test_vlm_chat_outputs_are_exact(vlm_runs):
    assert_exact(*vlm_runs)


def test_vlm_chat_real_mmmu(data_dir, model_dir):
    off, on, wl_off, wl_on = compare_keeping(vlm_chat.factory(options(model_dir, data=data_dir, limit=6)))
    assert summarize(on)["completed"] == 6 and summarize(on)["failed"] == 0
    assert summarize(on)["hit_rate"]["image"] == pytest.approx(5 / 6)  # one question, 2 users x 3 turns
    assert on.cache_stats["encoder"]["by_modality"]["image"]["hits"] == 1
    assert_exact(off, on, wl_off, wl_on)


def mmmu_folder(root: Path, rows: list) -> Path:
    """A shared-data folder holding an MMMU-format JSONL of ``rows`` (dicts or raw lines) and one real PNG."""
    (root / "mmmu" / "images").mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(
        root / "mmmu" / "images" / "a.png")
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (root / "mmmu" / "mmmu_pro_tool_sample_questions.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_vlm_chat_missing_image_fails_its_requests_and_the_replay_goes_on(tmp_path, model_dir):
    root = mmmu_folder(tmp_path, [
        {"question": "Which shape? <image 1>", "options": ["a", "b"], "image_1": "images/missing.png"},
        {"question": "What color? <image 1>", "options": ["red", "blue", "<image 2>"], "image_1": "images/a.png",
         "image_2": "images/a.png"}])
    off, on, wl_off, wl_on = compare_keeping(vlm_chat.factory(options(model_dir, data=root)))
    for run in (off, on):
        s = summarize(run)
        assert s["requests"] == 12 and s["failed"] == 6 and s["completed"] == 6
        assert all("missing.png" in e or "did not complete" in e for e in s["errors"])
        assert sum("missing.png" in e for e in s["errors"]) == 2  # each user's first turn; follow-ups have no history
        assert run.records[-1].ok
    assert on.cache_stats["prefix"]["requests_live"] == 0  # failures left nothing admitted
    assert summarize(on)["of_ceiling"] == pytest.approx({"prefix": 1.0, "image": 1.0})
    assert summarize(on)["hit_rate"]["image"] == pytest.approx(11 / 12)  # 2 images per prompt, 1 computed in all
    assert_exact(off, on, wl_off, wl_on)


def test_vlm_chat_malformed_data_names_file_and_line(tmp_path, model_dir):
    root = mmmu_folder(tmp_path, [{"question": "Q <image 1>", "options": ["a"], "image_1": "images/a.png"},
                                  "{not json", {"question": "Q <image 2>", "options": ["a"]}])
    with pytest.raises(TraceError, match=r"mmmu_pro_tool_sample_questions\.jsonl:2: ") as e:
        vlm_chat.factory(options(model_dir, data=root))
    assert e.value.line == 2
    (root / "mmmu" / "mmmu_pro_tool_sample_questions.jsonl").write_text(
        json.dumps({"question": "Q <image 2>", "options": ["a"], "image_1": "images/a.png"}) + "\n")
    with pytest.raises(TraceError, match=r":1: .*<image 2> but no image_2"):
        vlm_chat.factory(options(model_dir, data=root))


# ---------------------------------------------------------------------------------------------------- agent-model
@pytest.fixture(scope="module")
def agent_factory(model_dir):
    return agent.factory(options(model_dir, limit=5))  # session 0's 4 calls, session 1's first call


def test_agent_model_reuses_the_history_exactly(agent_factory):
    off, on, wl_off, wl_on = compare_keeping(agent_factory)
    assert summarize(off)["hit_rate"] == {"prefix": 0.0}
    by_rid = {r.rid: r.result for r in on.records}
    assert by_rid["gen-0#0"].hit_tokens == 0 and by_rid["gen-1#0"].hit_tokens > 0  # shared system prompt
    P = wl_on.page_size
    for i in (1, 2, 3):  # call i re-sends call i-1's prompt: every full page of it matches
        assert by_rid[f"gen-0#{i}"].hit_tokens == by_rid[f"gen-0#{i - 1}"].prompt_tokens // P * P
    assert summarize(on)["of_ceiling"] == pytest.approx({"prefix": 1.0})
    assert_exact(off, on, wl_off, wl_on)


def test_mooncake_model_keeps_the_shared_prefix_structure(model_dir):
    off, on, wl_off, wl_on = compare_keeping(agent.mooncake_factory(options(model_dir, limit=12)))
    s = summarize(on)
    assert s["completed"] == 12 and s["hit_rate"]["prefix"] > 0 and s["of_ceiling"] == pytest.approx({"prefix": 1})
    assert max(r.result.prompt_tokens for r in on.records) <= agent.MOONCAKE_BLOCKS * 2 * wl_on.page_size
    assert_exact(off, on, wl_off, wl_on)


# ---------------------------------------------------------------------------------------------------------- mixed
def test_mixed_interleaves_by_arrival_and_sums_the_caches(model_dir, agent_factory):
    vlm = vlm_chat.factory(options(model_dir, limit=3))
    off, on = compare(lambda: Mixed({"vlm-chat": vlm(), "agent-model": agent_factory()}), Schedule())
    arrivals = [r.arrival_s for r in on.records]
    assert arrivals == sorted(arrivals) and len(on.records) == 8
    assert {r.rid.split("/")[0] for r in on.records[:3]} == {"vlm-chat", "agent-model"}  # interleaved
    s = summarize(on)
    assert s["completed"] == 8 and set(s["hit_rate"]) == {"prefix", "image"}
    assert s["of_ceiling"] == pytest.approx({"prefix": 1.0, "image": 1.0})  # weighted ceilings combine exactly
    assert on.cache_stats["prefix"]["queries"] == 8 and "image" in on.cache_stats["encoder"]["by_modality"]
