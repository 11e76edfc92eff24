"""An eval harness against a real server: `lm-eval`'s `local-completions` model runs a
loglikelihood (multiple-choice) task defined on a small local dataset file that the test
writes (no hub: the tiny model's own tokenizer directory serves as lm-eval's tokenizer), and
each choice's log-likelihood equals the sum of transformers' log-probabilities of its tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from server_util import app_running, engine_running

pytestmark = pytest.mark.slow

DOCS = [("The sky is", [" blue", " green"], 0), ("Two plus two is", [" four", " five"], 0),
        ("Fire is", [" hot", " cold"], 0)]


def _task(folder: Path) -> None:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in DOCS))
    (folder / "nbserve_tiny.yaml").write_text(
        "task: nbserve_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
        "    aggregation: mean\n    higher_is_better: true\n")


def test_lm_eval_scores_a_local_multiple_choice_task(tiny_llama_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _task(tmp_path)
    with engine_running(tiny_llama_dir) as engine, app_running(engine) as url:
        args = (f"model={engine.model_name},base_url={url}/v1/completions,"
                f"tokenizer={tiny_llama_dir},tokenizer_backend=huggingface,num_concurrent=2,"
                "max_retries=1")
        lm = get_model("local-completions").create_from_arg_string(args)
        # only the task written here: indexing lm-eval's thousands of built-in tasks is not
        # what this checks (include_defaults=False)
        tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
        out: dict[str, Any] = lm_eval.simple_evaluate(
            model=lm, tasks=["nbserve_tiny"], task_manager=tasks, log_samples=True,
            bootstrap_iters=0)
        assert engine.stats()["model_errors"] == 0
    assert out["results"]["nbserve_tiny"]["acc,none"] in (0, 1 / 3, 2 / 3, 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                              dtype=torch.float32).eval()
    samples = out["samples"]["nbserve_tiny"]
    assert len(samples) == len(DOCS)
    for s in samples:
        # (context, continuation) as lm-eval scored them (its target delimiter included)
        for (context, choice), (loglik, _greedy) in zip(s["arguments"], s["filtered_resps"]):
            ctx, cont = lm._encode_pair(context, choice)  # the tokens lm-eval sent
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), -1)
            want = sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
            assert loglik == pytest.approx(want, abs=1e-3), (context, choice)
