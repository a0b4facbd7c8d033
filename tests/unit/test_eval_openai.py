"""The lm-eval comparison's pure parts (loadtest/eval_openai.py): its tasks' data, the
command lines it runs, how it reads lm-eval's output files and sets two servers' scores
side by side. The files read here are written in lm-eval 0.4's layout
(``<output_path>/<model>/results_<time>.json`` and ``samples_<task>_<time>.jsonl``), with
values made up for each test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loadtest.eval_openai import (
    ENGINE_KWARGS,
    GEN_TASK,
    MC_TASK,
    ROOT,
    RUNS,
    TASKS_DIR,
    Comparison,
    Scores,
    final_line,
    lm_eval_argv,
    read_scores,
    table,
    vllm_serve_argv,
)


def task(name: str) -> dict:
    return yaml.safe_load((ROOT / TASKS_DIR / f"{name}.yaml").read_text(encoding="utf-8"))


def rows(name: str) -> list[dict]:
    path = ROOT / task(name)["dataset_kwargs"]["data_files"]["test"]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_multiple_choice_task_is_twenty_facts_scored_by_loglikelihood():
    t = task(MC_TASK)
    assert t["task"] == MC_TASK and t["output_type"] == "multiple_choice"
    assert {m["metric"] for m in t["metric_list"]} == {"acc", "acc_norm"}
    docs = rows(MC_TASK)
    assert len(docs) == 20
    for d in docs:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        assert d["answer"] in range(4)
    # the right answer is at every position as often: a model that always picks one is at chance
    assert sorted(d["answer"] for d in docs) == sorted([0, 1, 2, 3] * 5)


def test_the_generation_task_is_five_questions_scored_by_exact_match():
    t = task(GEN_TASK)
    assert t["task"] == GEN_TASK and t["output_type"] == "generate_until"
    assert [m["metric"] for m in t["metric_list"]] == ["exact_match"]
    assert t["generation_kwargs"]["do_sample"] is False and t["generation_kwargs"]["max_gen_toks"] <= 32
    docs = rows(GEN_TASK)
    assert len(docs) == 5 and all(d["question"] and d["answer"] for d in docs)


def test_completions_runs_send_token_ids_once_and_text_once_with_the_directorys_tokenizer():
    ids, text, _ = RUNS
    argv = lm_eval_argv("lm_eval", ids, "demo", "http://127.0.0.1:8124/", "/m/demo", "/out")
    model_args = dict(a.split("=", 1) for a in argv[argv.index("--model_args") + 1].split(","))
    assert argv[argv.index("--model") + 1] == "local-completions"
    assert model_args == {
        "model": "demo",
        "base_url": "http://127.0.0.1:8124/v1/completions",
        "tokenizer": "/m/demo",
        "tokenizer_backend": "huggingface",
        "tokenized_requests": "True",
        "num_concurrent": "1",
        "max_retries": "1",
    }
    assert argv[argv.index("--tasks") + 1] == MC_TASK and argv[argv.index("--include_path") + 1] == TASKS_DIR
    assert "--log_samples" in argv and "--apply_chat_template" not in argv
    argv = lm_eval_argv("lm_eval", text, "demo", "http://127.0.0.1:8124", "/m/demo", "/out")
    assert "tokenized_requests=False" in argv[argv.index("--model_args") + 1]


def test_the_chat_run_applies_the_template_and_sends_no_tokenizer():
    chat = RUNS[2]
    argv = lm_eval_argv("lm_eval", chat, "demo", "http://127.0.0.1:8100", "/m/demo", "/out")
    assert argv[argv.index("--model") + 1] == "local-chat-completions"
    assert argv[argv.index("--model_args") + 1] == (
        "model=demo,base_url=http://127.0.0.1:8100/v1/chat/completions,num_concurrent=1,max_retries=1"
    )
    assert argv[argv.index("--tasks") + 1] == GEN_TASK and argv[-1] == "--apply_chat_template"


def test_vllm_serve_takes_the_same_engine_settings_as_flags():
    argv = vllm_serve_argv("python", "/m/demo", "demo", 8100)
    assert argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/demo"]
    assert argv[argv.index("--served-model-name") + 1] == "demo" and argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--dtype") + 1] == ENGINE_KWARGS["dtype"] == "float32"
    assert argv[argv.index("--max-model-len") + 1] == str(ENGINE_KWARGS["max_model_len"])
    # a flag that is true stands alone (vLLM's argparse takes no value after it)
    after = argv[argv.index("--enforce-eager") + 1 :]
    assert not after or after[0].startswith("--")


def write_run(
    out: Path, task_name: str, results: dict, samples: list[dict], stamp: str = "2026-01-01T00-00-00"
) -> None:
    d = out / "demo"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"results_{stamp}.json").write_text(json.dumps({"results": {task_name: results}}))
    (d / f"samples_{task_name}_{stamp}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def mc_sample(doc: int, lls: list[float]) -> dict:
    return {"doc_id": doc, "filtered_resps": [[str(ll), "False"] for ll in lls], "acc": 0.0}


def test_read_scores_takes_the_metrics_without_stderr_and_each_choices_loglikelihood(tmp_path):
    results = {
        "name": MC_TASK,
        "alias": MC_TASK,
        "sample_len": 2,
        "acc,none": 0.5,
        "acc_stderr,none": 0.1,
        "acc_norm,none": 0.25,
        "acc_norm_stderr,none": "N/A",
    }
    write_run(tmp_path, MC_TASK, results, [mc_sample(1, [-1.5, -2.25]), mc_sample(0, [-0.5, -3.0])])
    s = read_scores(tmp_path, MC_TASK)
    assert s.metrics == {"acc": 0.5, "acc_norm": 0.25}
    assert s.loglikelihoods == {0: (-0.5, -3.0), 1: (-1.5, -2.25)}
    assert s.generations == {}


def test_read_scores_takes_each_generated_answer(tmp_path):
    samples = [{"doc_id": 0, "filtered_resps": ["Rome"]}, {"doc_id": 1, "filtered_resps": ["  x y"]}]
    write_run(tmp_path, GEN_TASK, {"exact_match,none": 0.5, "exact_match_stderr,none": 0.5}, samples)
    s = read_scores(tmp_path, GEN_TASK)
    assert s.metrics == {"exact_match": 0.5}
    assert s.generations == {0: "Rome", 1: "  x y"} and s.loglikelihoods == {}


def test_read_scores_without_lm_evals_files_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no lm-eval results"):
        read_scores(tmp_path, MC_TASK)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "results_t.json").write_text(json.dumps({"results": {MC_TASK: {"acc,none": 1.0}}}))
    with pytest.raises(FileNotFoundError, match="no lm-eval samples"):
        read_scores(tmp_path, MC_TASK)


def sides(mc_b: dict, mc_v: dict, gen_b: dict, gen_v: dict, acc=(0.25, 0.25)) -> Comparison:
    def side(mc: dict, gen: dict, a: float) -> dict[str, Scores]:
        return {
            "mc-ids": Scores({"acc": a, "acc_norm": 0.3}, mc, {}),
            "gen-chat": Scores({"exact_match": 0.0}, {}, gen),
        }

    return Comparison(side(mc_b, gen_b, acc[0]), side(mc_v, gen_v, acc[1]))


def test_equal_scores_and_answers_are_equal_with_the_largest_loglikelihood_difference():
    c = sides({0: (-1.0, -2.0), 1: (-3.0, -0.5)}, {0: (-1.0004, -2.0), 1: (-3.0, -0.5002)}, {0: "a"}, {0: "a"})
    assert c.max_ll_abs_diff() == pytest.approx(4e-4)
    assert c.same_generations() == (1, 1)
    assert c.equal()
    line = final_line(c)
    fields = dict(f.split("=", 1) for f in line.removeprefix("lmeval: ").split())
    assert line.startswith("lmeval: ")
    assert fields == {
        "ballast_acc": "0.2500",
        "vllm_acc": "0.2500",
        "ballast_acc_norm": "0.3000",
        "vllm_acc_norm": "0.3000",
        "ballast_exact": "0.0000",
        "vllm_exact": "0.0000",
        "max_ll_abs_diff": "4.00e-04",
        "same_generations": "1/1",
        "equal": "true",
    }


def test_a_metric_that_differs_is_not_equal():
    c = sides({0: (-1.0, -2.0)}, {0: (-1.0, -2.0)}, {}, {}, acc=(0.25, 0.3))
    assert c.max_ll_abs_diff() == 0.0 and not c.metrics_equal() and not c.equal()
    assert "equal=false" in final_line(c)
    assert any(r.split() == ["mc-ids", "acc", "0.2500", "0.3000"] for r in table(c))


def test_a_different_answer_or_one_answered_on_one_side_only_is_not_the_same():
    c = sides({}, {}, {0: "a", 1: "b", 2: "c"}, {0: "a", 1: "B", 3: "c"})
    assert c.same_generations() == (1, 4)
    assert c.metrics_equal() and not c.equal()


def test_a_question_or_choice_missing_on_one_side_is_an_infinite_difference():
    assert sides({0: (-1.0,), 1: (-1.0,)}, {0: (-1.0,)}, {}, {}).max_ll_abs_diff() == float("inf")
    assert sides({0: (-1.0, -2.0)}, {0: (-1.0,)}, {}, {}).max_ll_abs_diff() == float("inf")
