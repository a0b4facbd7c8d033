"""loadtest.gpu_check: its plan, its runner's bounds (real processes), the figures file,
the wheels' pins, the 0.7 B Llama's geometry, and what its sections import.

The sections' commands are small shell commands here (the runner's job is to start,
bound, stop and record them, whatever they run); the benchmarks they run on a GPU have
tests of their own (test_bench_gpu.py, test_bench_model.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from loadtest import gpu_check as gc
from loadtest.gpu_check import Outcome, Section


def sh(script: str) -> tuple[str, ...]:
    return ("sh", "-c", script)


def test_the_plan_fits_the_budget_in_order(tmp_path):
    sections = gc.plan("python3", tmp_path / "no-wheels", tmp_path / "site", tmp_path / "llama", ["pydantic"])
    assert [s.name for s in sections] == [
        "wheels",
        "environment",
        "bench-gpu",
        "bench-model, demo Llama",
        "0.7 B Llama, built",
        "bench-model, 0.7 B Llama",
    ]
    assert sum(s.bound_s for s in sections) == gc.BUDGET_S == 480
    assert [s.needs_cuda for s in sections] == [False, False, True, True, True, True]
    assert sections[0].skip_reason == f"no wheels in {tmp_path / 'no-wheels'}; pydantic will be missing"
    last = sections[-1]
    assert last.after == "0.7 B Llama, built"
    assert last.argv[-4:] == ("--concurrency", "8,32", "--model", str(tmp_path / "llama"))
    assert "--no-vllm" in last.argv and "cuda" in last.argv


def test_wheels_there_are_installed_into_the_site_directory_where_a_package_is_missing(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for name in ("b-1.0-py3-none-any.whl", "a-2.0-cp312-cp312-manylinux_2_17_x86_64.whl", "notes.txt"):
        (wheels / name).write_text("")
    there = gc.plan("python3", wheels, tmp_path / "site", tmp_path / "llama", [])[0]
    assert there.skip_reason == "pydantic and what it imports are importable here"
    first = gc.plan("python3", wheels, tmp_path / "site", tmp_path / "llama", ["pydantic_core"])[0]
    assert first.skip_reason is None
    assert first.argv[:3] == ("python3", "-m", "pip")
    assert {"--no-index", "--no-deps", "--upgrade"} <= set(first.argv)
    i = first.argv.index("--target")
    assert first.argv[i + 1 :] == (
        str(tmp_path / "site"),
        str(wheels / "a-2.0-cp312-cp312-manylinux_2_17_x86_64.whl"),
        str(wheels / "b-1.0-py3-none-any.whl"),
    )


def test_a_section_runs_from_the_root_with_the_site_first_and_hugging_face_offline(tmp_path):
    env = gc.section_env({"PYTHONPATH": "/theirs", "KEEP": "1"}, tmp_path / "site")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site"), str(gc.ROOT), "/theirs"]
    o = gc.run_section(Section("env", sh("pwd; echo $HF_HUB_OFFLINE $PYTHONUNBUFFERED $KEEP"), 30), env, 30)
    assert (o.status, o.kind) == ("ok", "ok")
    assert o.output.splitlines() == [str(gc.ROOT), "1 1 1"]


def test_a_failing_section_keeps_its_output_and_its_exit_status():
    o = gc.run_section(Section("x", sh("echo partial; echo oops >&2; exit 3"), 30), {}, 30)
    assert (o.status, o.kind) == ("failed (exit 3)", "failed")
    assert o.output.splitlines() == ["partial", "oops"]
    o = gc.run_section(Section("y", ("/nonexistent/python",), 30), {}, 30)
    assert o.status.startswith("failed (cannot start:") and o.kind == "failed"


def test_a_section_past_whats_left_of_the_budget_is_stopped_with_its_children():
    # Its own bound is 30 s; the budget leaves 2: stopped at 2, the sleep it started too.
    script = "echo started; sleep 60 & echo $!; wait"
    (outcome,) = gc.run_all([Section("slow", sh(script), 30)], {}, budget_s=2.0, say=lambda line: None)
    assert (outcome.status, outcome.kind) == ("timed out after 2 s", "timed out")
    assert outcome.seconds < 30
    started, pid = outcome.output.splitlines()
    assert started == "started"
    try:
        gone = psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        gone = True
    assert gone


def test_cuda_sections_run_only_when_the_environment_says_so():
    def sections(cuda: bool) -> list[Section]:
        return [
            Section("environment", sh(f"echo '{gc.CUDA_LINE}{cuda}'"), 30),
            Section("gpu", sh("echo ran"), 30, needs_cuda=True),
            Section("cpu", sh("echo ran"), 30),
        ]

    said: list[str] = []
    without = gc.run_all(sections(False), {}, 100, say=said.append)
    assert [o.status for o in without] == ["ok", "skipped: no CUDA", "ok"]
    assert said[1] == "[gpu-check] gpu: skipped: no CUDA (0 s)"
    with_cuda = gc.run_all(sections(True), {}, 100, say=lambda line: None)
    assert [o.status for o in with_cuda] == ["ok", "ok", "ok"] and with_cuda[1].output == "ran\n"
    # CUDA there but a module missing: the environment fails, the CUDA sections still run (and say why they fail).
    broken = [Section("environment", sh(f"echo '{gc.CUDA_LINE}True'; exit 1"), 30), *sections(True)[1:]]
    assert [o.status for o in gc.run_all(broken, {}, 100, say=lambda line: None)] == ["failed (exit 1)", "ok", "ok"]


def test_a_section_after_one_that_failed_is_skipped_and_the_budget_ends_the_run():
    runs = [
        Section("build", sh("exit 1"), 30),
        Section("bench", sh("echo ran"), 30, after="build"),
        Section("known", sh("echo ran"), 30, skip_reason="nothing to do"),
        Section("late", sh("echo ran"), 30),
    ]
    # The clock: the run starts at 0 with 100 s; the first section ends at 150.
    times = iter([0.0, 0.0, 0.0, 150.0])
    out = gc.run_all(runs, {}, 100, clock=lambda: next(times, 150.0), say=lambda line: None)
    assert [o.status for o in out] == [
        "failed (exit 1)",
        "skipped: needs 'build', which did not pass",
        "skipped: nothing to do",
        "skipped: no time left in the budget",
    ]
    assert out[0].seconds == 150.0


def test_the_figures_file_has_every_section_and_ends_with_the_summary(tmp_path):
    outcomes = [
        Outcome("environment", "ok", 12.4, "cuda available: True\n", "python3 -m loadtest.gpu_check --probe"),
        Outcome("bench-gpu", "timed out after 105 s", 105.0, "1. decode\n"),
        Outcome("bench-model", "skipped: no CUDA", 0.0, ""),
        Outcome("build", "failed (exit 1)", 3.0, "Traceback\n"),
    ]
    last = gc.summary(outcomes, 120.6, 480, tmp_path / "f.md")
    assert last == (
        f"gpu-check: 1 ok, 1 skipped, 1 failed, 1 timed out in 121 s (budget 480 s); figures in {tmp_path}/f.md"
    )
    text = gc.render(outcomes, ["started then"], last)
    assert text.startswith("# gpu-check\n\nstarted then\n")
    assert (
        "## 1. environment: ok (12 s)\n\n`python3 -m loadtest.gpu_check --probe`\n\n```\ncuda available: True\n```"
    ) in text
    assert "## 2. bench-gpu: timed out after 105 s (105 s)" in text
    assert "## 3. bench-model: skipped: no CUDA (0 s)\n\n## 4." in text  # no empty block
    assert text.endswith(last + "\n")


def test_the_figures_go_to_out_else_the_run_directory(tmp_path):
    assert gc.figures_path(str(tmp_path / "f.md"), {"OUT": "/o"}) == tmp_path / "f.md"
    assert gc.figures_path(None, {"OUT": "/o"}) == Path("/o/gpu-check.md")
    assert gc.figures_path(None, {}) == gc.ROOT / ".run" / "gpu-check" / "figures.md"


def test_a_long_output_keeps_its_end(tmp_path):
    log = tmp_path / "log"
    log.write_text("x" * 100 + "the end\n")
    assert gc._tail(log, 1000) == "x" * 100 + "the end\n"
    assert gc._tail(log, 8) == "[the first 100 bytes left out]\nthe end\n"


def test_wheels_are_pinned_as_the_constraints_pin_them(tmp_path):
    constraints = tmp_path / "c.txt"
    constraints.write_text("# header\nPydantic_Core==2.50.4  # why\ntyping.extensions == 4.16.0\nother>=1\n")
    assert gc.pins(constraints, ["pydantic-core", "typing_extensions"]) == [
        "Pydantic_Core==2.50.4",
        "typing.extensions==4.16.0",
    ]
    with pytest.raises(ValueError, match="no pin for other, missing"):
        gc.pins(constraints, ["other", "missing"])
    real = gc.pins(gc.ROOT / "constraints.txt", gc.WHEELS)  # every wheel carried is pinned there
    assert len(real) == len(gc.WHEELS) and all("==" in r for r in real)


def test_the_wheels_are_fetched_for_the_lent_machines_python_and_platform(tmp_path):
    cmd = gc.fetch_command("python3", tmp_path, ["pydantic==2.14.3"], "3.12")
    assert cmd[:4] == ["python3", "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == list(gc.WHEEL_PLATFORMS)
    assert cmd[-3:] == ["-d", str(tmp_path), "pydantic==2.14.3"]


def test_the_big_llama_has_about_0_7_billion_parameters():
    from transformers import LlamaForCausalLM

    from ballast.model.demo import train_tokenizer

    tokenizer = train_tokenizer(context=gc.LLAMA_07B["context"])
    with torch.device("meta"):  # shapes only: nothing allocated
        model = LlamaForCausalLM(gc.llama_config(tokenizer, gc.LLAMA_07B))
    params = sum(p.numel() for p in model.parameters())
    assert 0.68e9 < params < 0.75e9
    assert model.config.vocab_size == 32000 > len(tokenizer)
    assert model.config.hidden_size // model.config.num_attention_heads == 128


def test_a_built_llama_loads_and_answers(tmp_path):
    from ballast.model.hf_checkpoint import load_checkpoint
    from ballast.model.hf_engine import HFBackend
    from ballast.model.protocol import Join

    small = dict(gc.LLAMA_07B, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    params, built_s, written_s = gc.build_llama(tmp_path / "m", small, device="cpu", dtype="bfloat16")
    assert params > 2 * 32000 * 64 and built_s >= 0 and written_s >= 0
    loaded = load_checkpoint(tmp_path / "m", "cpu", "bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    backend = HFBackend(loaded, name="m")
    got = backend.open_batch().run_chunk([Join(0, backend.text.encode("Hello!", 4), 4)], 4)
    assert len(got[0]) == 4


def test_what_the_sections_import_needs_no_ray_vllm_or_server_packages():
    # A lent GPU machine has torch, transformers, NVML and the carried wheels, none of these.
    absent = ("ray", "vllm", "pydantic_settings", "fastapi", "starlette", "uvicorn", "redis", "openai", "peft")
    modules = [m for m in gc.PROBE_MODULES if m.startswith(("ballast", "loadtest"))] + ["loadtest.gpu_check"]
    code = f"import sys; sys.modules.update(dict.fromkeys({absent!r})); " + "; ".join(f"import {m}" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], cwd=gc.ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_cpu_smoke_runs_the_benchmarks_parts(capsys):
    assert gc._smoke() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "CPU smoke:"
    steps = [line.split(":")[0].strip() for line in out[1:]]
    assert steps == ["config", "watchdog sample", "decode", "bench-model stacks"]
    assert "FAILED" not in "\n".join(out)
    assert "2 rows (ballast, generate)" in out[-1]


def test_packages_are_found_by_their_module_names():
    # The test environment has pydantic and the rest; "annotated-types" is the module annotated_types.
    assert gc.missing_packages() == []


def test_a_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    figures = tmp_path / "f.md"
    assert gc.main(["--dry-run", "--out", str(figures), "--wheels", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines[:6]] == [
        "1. wheels",
        "2. environment",
        "3. bench-gpu",
        "4. bench-model, demo Llama",
        "5. 0.7 B Llama, built",
        "6. bench-model, 0.7 B Llama",
    ]
    assert "(within 100 s, needs CUDA)" in lines[2]
    assert lines[-1] == f"budget 480 s; figures to {figures}"
    assert not figures.exists()


def test_a_budget_out_of_bounds_is_refused():
    with pytest.raises(SystemExit):
        gc.main(["--budget-s", "10"])
