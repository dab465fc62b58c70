"""lm-evaluation-harness, a client this project did not write, runs the local tasks the repository ships
(eval/harness_tasks/) on an exported model directory: its scores are our model's own log-likelihoods, and its
generations stop at the harness's own length limit (docs/harness.md)."""

from __future__ import annotations


import pytest
import torch
import yaml
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from model.loading import load_model
from scripts.convert_to_llama import convert_to_llama
from tests.paths import REPO

TASKS = REPO / "eval" / "harness_tasks"


def _generation_kwargs() -> dict:
    config = yaml.load((TASKS / "mininorm_qa.yaml").read_text(), Loader=yaml.BaseLoader)  # no !function tags
    return config["generation_kwargs"]


@pytest.fixture(scope="module")
def harness_run(tiny_models, tmp_path_factory):
    """The documented run, on the Llama export of the untrained model (it never emits <|im_end|>, so only a
    length limit ends its answers)."""
    export = convert_to_llama(tiny_models.pretrain, tmp_path_factory.mktemp("harness") / "llama")
    results = simple_evaluate(model="hf", model_args={"pretrained": str(export), "dtype": "float32"},
                              tasks=["mininorm"], task_manager=TaskManager(include_path=str(TASKS)),
                              device="cpu", batch_size=8, log_samples=True, apply_chat_template=True)
    return export, results


def test_the_local_tasks_run_and_score(harness_run) -> None:
    _, results = harness_run
    assert set(results["results"]) == {"mininorm_qa", "mininorm_cloze"}
    assert 0 <= results["results"]["mininorm_cloze"]["acc,none"] <= 1
    assert results["results"]["mininorm_qa"]["exact_match,none"] == 0  # an untrained model knows nothing
    assert {name: len(samples) for name, samples in results["samples"].items()} == {"mininorm_qa": 20,
                                                                                   "mininorm_cloze": 20}


def test_answers_stop_at_the_harness_limit(harness_run, tiny_models, tokenizer) -> None:
    """Each answer is our greedy answer of exactly max_gen_toks tokens, cut at the task's stop strings: the
    harness's own limit held (a saved max_new_tokens of 256 would have made them run on)."""
    _, results = harness_run
    kwargs = _generation_kwargs()
    model, _ = load_model(tiny_models.pretrain, device="cpu", dtype="float32")
    for sample in results["samples"]["mininorm_qa"][:6]:
        question = f"Question: {sample['doc']['question']}\nAnswer:"  # the task's doc_to_text
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=int(kwargs["max_gen_toks"]), do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        assert len(new) == int(kwargs["max_gen_toks"])
        ours = tokenizer.decode(new)
        for stop in kwargs["until"]:
            ours = ours.split(stop)[0]
        assert sample["resps"][0][0] == ours


def test_cloze_log_likelihoods_are_ours(harness_run, tiny_models, tokenizer) -> None:
    """The harness's number for each ending equals log p(ending | context) computed by our own model, where the
    context is our chat template's rendering of the sentence start."""
    _, results = harness_run
    model, _ = load_model(tiny_models.pretrain, device="cpu", dtype="float32")
    for sample in results["samples"]["mininorm_cloze"][:5]:
        doc = sample["doc"]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": doc["context"]}], tokenize=False,
                                                 add_generation_prompt=True)
        # The requests the harness built: (context, ending) per choice.
        assert [tuple(args) for args in sample["arguments"]] == [(rendered, choice) for choice in doc["choices"]]
        # The harness moves the context's trailing whitespace (the template's "\n" after "assistant") into the
        # ending, and cuts the ending's tokens off the encoded whole; the same offset for every choice.
        context = rendered.rstrip()
        context_ids = tokenizer(context)["input_ids"]
        for choice, response in zip(doc["choices"], sample["resps"]):
            whole = tokenizer(context + rendered[len(context):] + choice)["input_ids"]
            assert whole[:len(context_ids)] == context_ids
            with torch.no_grad():
                log_probs = model(torch.tensor([whole])).logits[0, :-1].log_softmax(-1)
            ending = torch.tensor(whole[len(context_ids):])
            ours = log_probs[len(context_ids) - 1:].gather(-1, ending[:, None]).sum().item()
            assert float(response[0][0]) == pytest.approx(ours, abs=1e-3), (doc["context"], choice)
