"""``coserve bench-finetune``'s rounds: the systems' order alternates, ratios are taken within a round and pooled.

The workers (a subprocess each, training for real) are replaced by plain rows; the workers themselves run in the
benchmark, not here."""

from __future__ import annotations

import argparse
import json

import pytest

from coserve.bench import finetune as bench


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--model", "m", "--targets", "down_proj", "--config", "cheap:0", "--config", "all:0",
                         "--device", "cpu", *extra])


def test_rounds_alternate_the_systems_and_pool_the_ratios_taken_within_each(monkeypatch, tmp_path, capsys):
    calls = []
    rates = iter([100.0, 150.0, 120.0,  # round 0: HF PEFT first, then the settings as given
                  130.0, 140.0, 200.0])  # round 1: the settings reversed, HF PEFT last

    def fake_spawn(spec: dict) -> dict:
        calls.append((spec["system"], spec.get("rematerialize"), spec.get("window_tokens")))
        row = {"system": spec["system"], "targets": spec["targets"], "tokens_per_s": next(rates),
               "kept_bytes_per_token": 10.0, "autograd_bytes_per_token": 40.0, "peak_rss_bytes": 2**20}
        if spec["system"] == "coserve":
            row.update(rematerialize=spec["rematerialize"], window_tokens=spec["window_tokens"])
        return row

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    out = tmp_path / "r.json"
    assert bench.run(_args("--repeats", "2", "--out", str(out))) == 0
    assert calls == [("hf", None, None), ("coserve", "cheap", 0), ("coserve", "all", 0),
                     ("coserve", "all", 0), ("coserve", "cheap", 0), ("hf", None, None)]
    report = json.loads(out.read_text())
    assert report["repeats"] == 2
    ratios = {(r["repeat"], r["rematerialize"]): r["ratio_tokens_per_s"] for r in report["rows"]
              if r["system"] == "coserve"}
    assert ratios == {(0, "cheap"): 1.5, (0, "all"): 1.2, (1, "cheap"): 0.7, (1, "all"): 0.65}
    pooled = {p["setting"]: p for p in report["pooled"]}
    assert pooled["cheap:0"]["ratio_tokens_per_s_median"] == pytest.approx(1.1)
    assert (pooled["all:0"]["ratio_tokens_per_s_min"], pooled["all:0"]["ratio_tokens_per_s_max"]) == (0.65, 1.2)
    assert pooled["cheap:0"]["rounds"] == 2
    assert "pooled   down_proj" in capsys.readouterr().out


def test_repeats_must_be_positive(monkeypatch):
    monkeypatch.setattr(bench, "_spawn", lambda spec: pytest.fail("no run for a bad --repeats"))
    with pytest.raises(ValueError, match="--repeats"):
        bench.run(_args("--repeats", "0"))


def test_a_setting_may_name_its_memory_target(monkeypatch, tmp_path):
    specs = []

    def fake_spawn(spec: dict) -> dict:
        specs.append(spec)
        row = {"system": spec["system"], "targets": spec["targets"], "tokens_per_s": 100.0,
               "kept_bytes_per_token": 10.0, "autograd_bytes_per_token": 40.0, "peak_rss_bytes": 2**20}
        if spec["system"] == "coserve":
            row.update({k: spec[k] for k in ("rematerialize", "window_tokens", "memory_target") if k in spec})
        return row

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--model", "m", "--targets", "down_proj", "--config", "cheap:0", "--config", "cheap:0:1.0",
                         "--device", "cpu", "--out", str(out)])
    assert bench.run(args) == 0
    coserve = [s for s in specs if s["system"] == "coserve"]
    assert "memory_target" not in coserve[0] and coserve[1]["memory_target"] == 1.0
    assert [p["setting"] for p in json.loads(out.read_text())["pooled"]] == ["cheap:0", "cheap:0:1"]


@pytest.mark.parametrize("bad", ["cheap:0:0", "cheap:0:1.5", "cheap:0:much", "some:0", "cheap:x"])
def test_a_bad_setting_is_refused_naming_the_flag(monkeypatch, bad):
    monkeypatch.setattr(bench, "_spawn", lambda spec: pytest.fail("no run for a bad --config"))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(ValueError, match="--config"):
        bench.run(p.parse_args(["--model", "m", "--config", bad, "--device", "cpu"]))


@pytest.mark.parametrize("content, says", [
    (None, "cannot be read as JSON"),  # no such file: it ran on synthetic text in its place
    ('{"x": 1}', "must be a JSON array of Alpaca records"),  # was a TypeError in the worker
    ('[{"instruction": "a", "output": "b"}, {"text": "c"}]', "record 2 is not an Alpaca record"),
    ('[{"instruction": "a", "output": 5}]', "record 1 is not an Alpaca record"),
])
def test_a_data_file_that_is_no_alpaca_array_is_refused_naming_the_flag(monkeypatch, tmp_path, content, says):
    monkeypatch.setattr(bench, "_spawn", lambda spec: pytest.fail("no run for bad --data"))
    path = tmp_path / "d.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"^--data: {path}.*{says}"):
        bench.run(_args("--data", str(path)))
