"""Rollout decoding speed: the GenerationEngine, transformers' generate() and llama.cpp, side by side.

One model of `--preset` (the pretraining default, cpu-wide) with fresh weights from a fixed seed: decoding speed does
not depend on the weights' values, and greedy decoding with a fixed number of new tokens (end-of-turn ignored)
keeps the work the same in every variant. Variants, for one stream and for a batch of `--batch` streams (the same
prompt `--batch` times, as a GRPO group is):

    engine      model.generation.GenerationEngine as trainer/grpo.py's rollouts drive it (submit all, step()),
                decoding as `--decode` says (default: the rollouts' under --compile auto, a compiled step
                over a static KV cache; compiled once, in the warm-up round)
    engine@REF  the same, with model/generation.py as it is at git revision REF (--engine_ref; e.g. HEAD), so a
                change of the engine is measured against its baseline in the same run (its own default decode
                mode; model/decode_step.py is imported as it is now)
    generate    transformers' generate() on the same model object (greedy, DynamicCache)
    llama.cpp   the pinned llama-cpp-python on the model's f32 GGUF (scripts/convert_to_gguf.py), its stock
                settings (f16 KV cache), greedy via Llama.generate; one stream only (the high-level binding
                decodes one sequence)

The torch variants run under `--stance` (default force_eager: trainer/grpo.py's rollouts decode under
`torch.compiler.set_stance("force_eager")`, which also runs the compiled RMSNorm kernel's function eagerly; `default`
is what chat and the server run). All variants run on `--threads` threads (torch.set_num_threads and llama.cpp's
n_threads). Rounds are interleaved (every variant once per round, in the same order) and the table shows the
median tokens/s over the rounds and its ratio to llama.cpp's one stream. Tokens/s counts generated tokens only
(all streams), prefill time included.

    python eval/benchmarks/bench_rollout.py                          # cpu-wide, 200 tokens, batch 8, 5 rounds
    python eval/benchmarks/bench_rollout.py --engine_ref HEAD --rounds 7
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import importlib.util  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import TYPE_CHECKING, Callable  # noqa: E402

import torch  # noqa: E402

from model.generation import DECODE_MODES  # noqa: E402
from model.config import PRESETS  # noqa: E402
from trainer.cli import MAX_COUNT, DefaultsHelpFormatter, ToolParser, benchmark_threads, int_within, run_main, seed  # noqa: E402
from trainer.grpo import rollout_decode  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import REPO_ROOT  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from model import MiniNormForCausalLM

PROMPT = "Once upon a time, in a small village by the river, there lived an old fisherman who"
NO_EOS = (-1,)  # an id no token has: every stream decodes exactly --tokens new tokens


def fresh_model(root: Path, preset: str, seed: int) -> tuple[MiniNormForCausalLM, PreTrainedTokenizerBase, Path]:
    """(model, tokenizer, model directory): `preset` with weights from `seed`, saved for the GGUF conversion."""
    from dataset.tokenization import load_tokenizer
    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.export import save_model_dir

    tokenizer = load_tokenizer()
    config = MiniNormConfig.from_preset(preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = MiniNormForCausalLM(config).eval()
    path = root / f"{preset}-seed{seed}"
    save_model_dir(model, tokenizer, path)
    return model, tokenizer, path


def engine_module_at(ref: str, root: Path) -> ModuleType:
    """model/generation.py as it is at git revision `ref`, imported under its own name."""
    source = subprocess.run(["git", "show", f"{ref}:model/generation.py"], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = root / "generation_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("generation_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def engine_run(module: ModuleType, model: MiniNormForCausalLM, tokenizer: PreTrainedTokenizerBase,
               prompt: list[int], batch: int, tokens: int, decode: str | None = None) -> Callable[[], int]:
    options = {} if decode is None else {"decode": decode}

    def run() -> int:
        engine = module.GenerationEngine(model, tokenizer, max_batch=batch, eos_token_ids=NO_EOS, **options)
        settings = module.GenerationSettings(max_new_tokens=tokens, temperature=0.0)
        generations = [engine.submit(prompt, settings) for _ in range(batch)]
        while not all(generation.done for generation in generations):
            engine.step()
        assert all(len(g.token_ids) == tokens for g in generations), [g.finish_reason for g in generations]
        return batch * tokens
    return run


def generate_run(model: MiniNormForCausalLM, prompt: list[int], batch: int, tokens: int) -> Callable[[], int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=model.config.pad_token_id)
    ids = torch.tensor([prompt] * batch)

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert out.shape == (batch, len(prompt) + tokens), out.shape
        return batch * tokens
    return run


def llama_cpp_run(gguf: Path, prompt: list[int], tokens: int, threads: int) -> Callable[[], int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + tokens + 8, n_threads=threads, n_threads_batch=threads,
                seed=0, verbose=False)

    def run() -> int:
        count = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == tokens:
                break
        return count
    return run


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--preset", default="cpu-wide", choices=list(PRESETS), help="model shape (model/config.py)")
    parser.add_argument("--tokens", type=int_within(1), default=200, help="new tokens per stream")
    parser.add_argument("--batch", type=int_within(1), default=8, help="streams of the batched rows")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=5,
                        help="interleaved rounds; the table shows medians")
    parser.add_argument("--threads", type=benchmark_threads(), default=os.cpu_count(), help="threads of every variant")
    parser.add_argument("--engine_ref", default=None, help="also run model/generation.py at this git revision")
    parser.add_argument("--seed", type=seed, default=0, help="draws the model's fresh weights")
    parser.add_argument("--decode", default=rollout_decode("auto"), choices=DECODE_MODES,
                        help="the engine's decode mode (model/generation.py)")
    parser.add_argument("--stance", default="force_eager", choices=("force_eager", "default"),
                        help="torch.compiler stance of the torch variants (force_eager: as GRPO/PPO rollouts run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from model import generation

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, tokenizer, model_dir = fresh_model(root, args.preset, args.seed)
        prompt = tokenizer(PROMPT)["input_ids"]
        context = model.config.max_position_embeddings
        if args.tokens > context - len(prompt):  # the engine stops there: an AssertionError after the first round
            parser.error(f"--tokens {args.tokens}: the {args.preset} model's context of {context} takes at most "
                         f"{context - len(prompt)} new tokens after the {len(prompt)}-token prompt; allowed: 1 .. "
                         f"{context - len(prompt)}")
        gguf = root / "model-f32.gguf"
        subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "convert_to_gguf.py"), "--model_path",
                        str(model_dir), "--outfile", str(gguf), "--outtype", "f32"], check=True,
                       stdout=subprocess.DEVNULL)
        runs: dict[tuple[str, int], Callable[[], int]] = {}
        for batch in (1, args.batch):
            if args.engine_ref:
                runs[(f"engine@{args.engine_ref}", batch)] = engine_run(
                    engine_module_at(args.engine_ref, root), model, tokenizer, prompt, batch, args.tokens)
            runs[("engine", batch)] = engine_run(generation, model, tokenizer, prompt, batch, args.tokens, args.decode)
            runs[("generate", batch)] = generate_run(model, prompt, batch, args.tokens)
        runs[("llama.cpp", 1)] = llama_cpp_run(gguf, prompt, args.tokens, args.threads)
        print(f"machine: {machine_line()}")
        print(f"{args.preset} (seed {args.seed}), prompt {len(prompt)} tokens, {args.tokens} new tokens per stream, "
              f"greedy, engine decode {args.decode}, torch stance {args.stance}, {args.threads} thread(s) everywhere, "
              f"median of {args.rounds} interleaved rounds (+1 warm-up)")
        rates: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
        for round_index in range(args.rounds + 1):
            for key, run in runs.items():
                with torch.compiler.set_stance(args.stance if key[0] != "llama.cpp" else "default"):
                    start = time.perf_counter()
                    count = run()
                    seconds = time.perf_counter() - start
                if round_index:  # round 0 warms up every variant
                    rates[key].append(count / seconds)
            print(f"  round {round_index}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}",
                  file=sys.stderr)
        print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    reference = statistics.median(rates[("llama.cpp", 1)])
    print("\n| variant | streams | tokens/s (median) | min-max | / llama.cpp 1 stream |\n|---|---|---|---|---|")
    for (name, batch), values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {batch} | {median:.0f} | {min(values):.0f}-{max(values):.0f} | {median / reference:.2f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
