"""Bounded JSON-lines logs (protocol/storage/jsonlog.py): metrics.jsonl and versions.jsonl rotate into
numbered segments past a byte cap, keep at most K of them, read back oldest first across segments, survive a
torn last line, and a learner's restart drops the rows after its save without reading the whole log."""

from __future__ import annotations

import json
import threading
import types

import pytest

from heterorl.peer.daemon.runtime import PeerRuntime
from heterorl.protocol.storage import jsonlog
from heterorl.protocol.storage.jsonlog import append_row, drop_rows_after, read_rows, segment_path, segments

pytestmark = pytest.mark.fast


def _row(step: int) -> dict:
    return {"step": step, "reward/mean": 0.25, "pad": "x" * 40}


ROW_BYTES = len(json.dumps(_row(10)) + "\n")  # steps 10..99: every row the same size


def _sizes(path) -> list[int]:
    return [p.stat().st_size for p in segments(path)]


def test_rows_read_back_in_order_and_nothing_is_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert list(read_rows(path)) == [] and segments(path) == []
    for s in range(5):
        append_row(path, _row(s))
    assert [r["step"] for r in read_rows(path)] == list(range(5))
    assert segments(path) == [path]


def test_rotation_caps_each_segment_and_keeps_k_of_them_oldest_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    cap, keep = 10 * ROW_BYTES, 3
    for s in range(10, 100):
        append_row(path, _row(s), max_bytes=cap, keep=keep)
    names = [p.name for p in segments(path)]
    assert names == ["metrics.2.jsonl", "metrics.1.jsonl", "metrics.jsonl"]
    assert all(size <= cap for size in _sizes(path)) and sum(_sizes(path)) <= keep * cap
    steps = [r["step"] for r in read_rows(path)]
    assert steps == list(range(100 - len(steps), 100)) and len(steps) == 30  # the newest, contiguous
    assert not segment_path(path, 3).exists()


def test_a_row_bigger_than_the_cap_is_written_whole_in_a_segment_of_its_own(tmp_path):
    path = tmp_path / "v.jsonl"
    append_row(path, {"step": 0}, max_bytes=20, keep=2)
    append_row(path, {"step": 1, "big": "y" * 100}, max_bytes=20, keep=2)
    assert [r["step"] for r in read_rows(path)] == [0, 1]
    assert [p.name for p in segments(path)] == ["v.1.jsonl", "v.jsonl"]
    append_row(path, {"step": 2}, max_bytes=20, keep=1)  # keep 1: the current segment alone
    assert [r["step"] for r in read_rows(path)] == [2] and segments(path)[-1] == path


def test_the_runtime_keeps_metrics_bounded(tmp_path, monkeypatch):
    """What the learner and sampler write through (PeerRuntime.append_jsonl) stays within the defaults."""
    monkeypatch.setattr(jsonlog, "DEFAULT_MAX_BYTES", 8 * ROW_BYTES)
    rt = types.SimpleNamespace(state_dir=tmp_path)
    for s in range(10, 100):
        PeerRuntime.append_jsonl(rt, "metrics.jsonl", _row(s))
    path = tmp_path / "metrics.jsonl"
    assert sum(_sizes(path)) <= jsonlog.DEFAULT_KEEP * 8 * ROW_BYTES
    assert len(segments(path)) == jsonlog.DEFAULT_KEEP
    assert [r["step"] for r in read_rows(path)][-1] == 99


def test_a_torn_last_line_is_skipped_and_cut_before_the_next_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_row(path, _row(1))
    with path.open("a") as f:
        f.write('{"step": 2, "reward')  # a kill mid-append
    assert [r["step"] for r in read_rows(path)] == [1]
    append_row(path, _row(3))
    lines = path.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 3]  # not glued onto the torn half
    segment_path(path, 1).write_text(json.dumps(_row(0)) + "\n[1, 2]\n\n{nope")  # an older one, torn too
    assert [r["step"] for r in read_rows(path)] == [0, 1, 3]


def _old_continue_after_published(path, saved_step):
    """What the learner did on restart (learner.py, before drop_rows_after): the whole file, rows kept whose
    step is <= saved_step, a line that does not parse counting as infinitely late."""

    def step_of(line):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return float("inf")

    return [line for line in path.read_text().splitlines() if step_of(line) <= saved_step]


def test_drop_rows_after_keeps_what_the_learner_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(_row(s)) + "\n" for s in range(8)) + '{"no_step": 1}\n\n' + '{"step": 8, "re'
    path.write_text(text)
    (tmp_path / "old.jsonl").write_text(text)
    expected = _old_continue_after_published(tmp_path / "old.jsonl", 4)
    assert drop_rows_after(path, "step", 4) == 6  # steps 5-7, the row without a step, the blank, the torn
    assert path.read_text().splitlines() == expected
    assert [r["step"] for r in read_rows(path)] == [0, 1, 2, 3, 4]
    assert drop_rows_after(path, "step", 4) == 0 and drop_rows_after(tmp_path / "none.jsonl", "step", 0) == 0


def test_drop_rows_after_reaches_back_only_as_far_as_it_must(tmp_path):
    path = tmp_path / "metrics.jsonl"
    cap = 10 * ROW_BYTES
    for s in range(10, 50):
        append_row(path, _row(s), max_bytes=cap, keep=4)
    assert [p.name for p in segments(path)] == [f"metrics.{n}.jsonl" for n in (3, 2, 1)] + ["metrics.jsonl"]
    oldest = [p.stat().st_mtime_ns for p in segments(path)[:2]]
    assert drop_rows_after(path, "step", 34) == 15  # 35..39 in metrics.1.jsonl, 40..49 in the current one
    assert [r["step"] for r in read_rows(path)] == list(range(10, 35))
    assert [p.stat().st_mtime_ns for p in segments(path)[:2]] == oldest  # the older segments: not rewritten
    append_row(path, _row(35), max_bytes=cap, keep=4)  # the redone update goes on after the kept rows
    assert [r["step"] for r in read_rows(path)] == list(range(10, 36))


def test_threads_appending_at_once_lose_and_tear_nothing(tmp_path):
    path = tmp_path / "versions.jsonl"
    cap = 40 * ROW_BYTES

    def writer(w: int) -> None:
        for i in range(100):
            append_row(
                path,
                {"step": 10 + (w * 100 + i) % 90, "w": w, "i": i, "pad": "x" * 40},
                max_bytes=cap,
                keep=20,
            )

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = list(read_rows(path))
    assert len(rows) == 400 and all(size <= cap for size in _sizes(path))
    for w in range(4):
        assert [r["i"] for r in rows if r["w"] == w] == list(range(100))
    assert sum(len(p.read_text().splitlines()) for p in segments(path)) == 400  # no torn or glued line
