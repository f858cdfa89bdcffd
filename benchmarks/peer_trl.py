"""Miles against its peer, TRL's ``GRPOTrainer``, on the embedded default task: the same initial weights (the tiny
Llama that ``miles train`` builds from its seed), the same prompts in the same order, the same reward, 16 prompts x 8
samples a step, 200 steps, the same optimizer settings; TRL first, then ``miles train``, one after the other.
Prints both median seconds a step, both eval curves (greedy, on the 64 held-out prompts) and the ratio last.

    python benchmarks/peer_trl.py                                  # sync against TRL
    python benchmarks/peer_trl.py --schedule sync,one_step_off,fully_async --repeats 2

TRL runs in an environment of its own, made by this script on its first run (``--trl-venv``, default
``.cache/peer-trl/venv``: ``pip install trl==TRL_VERSION`` with ``constraints.txt``, so torch stays the CPU build,
and this checkout, whose task, prompts and reward the TRL run imports). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles_core.default.threads import omp_wait_policy

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
DEFAULT_VENV = ROOT / ".cache" / "peer-trl" / "venv"
BATCH_SIZE, GROUP_SIZE, MAX_NEW_TOKENS = 16, 8, 8
EVAL_EVERY = 25


# -- the TRL side (runs in the TRL environment) -------------------------------------------------------------------


def trl_worker(spec: dict) -> dict:
    """TRL's GRPOTrainer on the default task, with Miles' settings; eval (greedy, Miles' reward) before training and
    every ``EVAL_EVERY`` steps, outside the timed steps."""
    import datasets  # deferred: only the TRL environment has them
    import torch
    import transformers
    import trl

    from miles_core.default.task import echo_last_prompts, echo_last_reward
    from miles_core.rollout.prompt_order import step_prompts
    from miles_core.run_setup import default_model

    seed, steps = spec["seed"], spec["steps"]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    model_dir = default_model(Path(spec["run_dir"]), seed=seed)  # what `miles train` builds from the same seed
    train, evaluation = echo_last_prompts(seed=seed)
    order = [p for step in range(steps) for p in step_prompts(train, step, seed=seed, batch_size=BATCH_SIZE)]
    dataset = datasets.Dataset.from_list([{"prompt": p.text, "label": p.label} for p in order])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)

    def reward(prompts, completions, label, **_):
        return [
            echo_last_reward(prompt=p, response=c, label=lab, metadata={})
            for p, c, lab in zip(prompts, completions, label, strict=True)
        ]

    def evaluate() -> float:
        model.eval()
        inputs = tokenizer([p.text for p in evaluation], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        model.train()
        return statistics.fmean(
            echo_last_reward(prompt=p.text, response=t, label=p.label, metadata={})
            for p, t in zip(evaluation, texts, strict=True)
        )

    class Timer(transformers.TrainerCallback):
        """Each step's seconds, from the end of the previous one (its eval excluded) to its own end."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.evals: dict[int, float] = {0: evaluate()}
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.mark)
            if state.global_step % EVAL_EVERY == 0 or state.global_step == steps:
                self.evals[state.global_step] = evaluate()
            self.mark = time.perf_counter()

    config = trl.GRPOConfig(
        output_dir=str(Path(spec["run_dir"]) / "trl"),
        max_steps=steps,
        per_device_train_batch_size=BATCH_SIZE * GROUP_SIZE,
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS,
        shuffle_dataset=False,  # the dataset is Miles' data order already
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # PPO-clip averaged over the batch's response tokens, as Miles' loss
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_cpu=True,
        bf16=False,  # float32 as Miles (GRPOConfig's default is bf16)
        gradient_checkpointing=False,  # no recomputed forward, as Miles (GRPOConfig's default is True)
        seed=seed,
        logging_steps=EVAL_EVERY,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    started = time.perf_counter()
    trainer.train()
    return {
        "seconds": timer.seconds,
        "evals": timer.evals,
        "wall_s": time.perf_counter() - started,
        "weights": _digest(model_dir),
    }


# -- the driver (runs in Miles' environment) ----------------------------------------------------------------------


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL environment's python, made on first use (a marker names what it was made with)."""
    python = venv / "bin" / "python"
    marker = venv / f".installed-trl-{TRL_VERSION}"
    if marker.exists():
        return python
    print(f"making the TRL environment in {venv} (pip install trl=={TRL_VERSION}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"trl=={TRL_VERSION}", "-e", str(ROOT)], check=True)
    marker.touch()
    return python


def run_trl(python: Path, *, seed: int, steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="miles-peer-trl-") as run_dir:
        spec = json.dumps({"seed": seed, "steps": steps, "run_dir": run_dir, "threads": threads})
        out = Path(run_dir) / "result.json"
        env = {**os.environ, **omp_wait_policy(), "PYTHONPATH": str(ROOT)}  # OpenMP waits as in Miles' processes
        with ChildCpuSeconds() as cpu:
            subprocess.run(
                [str(python), __file__, "--trl-worker", spec, "--result", str(out)],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
        result = json.loads(out.read_text())
    result["evals"] = {int(step): value for step, value in result["evals"].items()}
    result["cpu_s"] = cpu.seconds
    return result


def run_miles(*, seed: int, steps: int, schedule: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="miles-peer-miles-") as run_dir:
        started = time.perf_counter()
        command = [
            *(sys.executable, "-m", "miles_core.cli.main", "train", "--no-progress"),
            *("--seed", str(seed), "--num-steps", str(steps), "--run-schedule", schedule),
            *("--run-eval-every", str(EVAL_EVERY), "--output-dir", run_dir),
        ]
        with ChildCpuSeconds() as cpu:
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        weights = _digest(Path(run_dir) / "initial_model")
    # a step's time without its eval and checkpoint, as TRL's is measured
    seconds = [
        r["time/step"] - r.get("time/eval", 0.0) - r.get("time/checkpoint", 0.0) for r in rows if "time/step" in r
    ]
    evals = {int(r["step"]): r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}
    return {"seconds": seconds, "evals": evals, "wall_s": wall, "weights": weights, "cpu_s": cpu.seconds}


class ChildCpuSeconds:
    """The CPU seconds (user and system) of the child processes that ended inside the block (the engine's too: it
    is the Miles driver's child, waited for when the run stops it)."""

    def __enter__(self) -> ChildCpuSeconds:
        self._before = _children_cpu()
        self.seconds = 0.0
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = _children_cpu() - self._before


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _digest(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()[:16]


def _curve(evals: dict[int, float]) -> str:
    return " ".join(f"{step}:{value:.3f}" for step, value in sorted(evals.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="sync", help="Miles schedules to run, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="TRL then each schedule, this many times")
    parser.add_argument("--trl-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="torch threads of the TRL process (0, the default: torch's, one per core, as Miles' sync trainer)",
    )
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        args.result.write_text(json.dumps(trl_worker(json.loads(args.trl_worker))))
        return
    python = ensure_trl_venv(args.trl_venv)
    schedules = args.schedule.split(",")
    ratios: dict[str, list[float]] = {s: [] for s in schedules}
    for repeat in range(args.repeats):
        trl_result = run_trl(python, seed=args.seed, steps=args.steps, threads=args.trl_threads)
        trl_step = statistics.median(trl_result["seconds"])
        print(
            f"[{repeat + 1}] TRL {TRL_VERSION} GRPOTrainer: {trl_step:.3f} s/step (median of "
            f"{len(trl_result['seconds'])}), {trl_result['wall_s']:.0f} s in all, {trl_result['cpu_s']:.0f} CPU s, "
            "initial weights "
            f"{trl_result['weights']}\n    eval {_curve(trl_result['evals'])}",
            flush=True,
        )
        for schedule in schedules:
            miles_result = run_miles(seed=args.seed, steps=args.steps, schedule=schedule)
            miles_step = statistics.median(miles_result["seconds"])
            same = "same" if miles_result["weights"] == trl_result["weights"] else "DIFFERENT"
            ratios[schedule].append(miles_step / trl_step)
            print(
                f"[{repeat + 1}] miles train --run-schedule {schedule}: {miles_step:.3f} s/step (median of "
                f"{len(miles_result['seconds'])}), {miles_result['wall_s']:.0f} s in all with start-up, "
                f"{miles_result['cpu_s']:.0f} CPU s, initial "
                f"weights {miles_result['weights']} ({same})\n    eval {_curve(miles_result['evals'])}",
                flush=True,
            )
    for schedule, values in ratios.items():
        spread = f" (runs: {', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""
        print(f"miles {schedule} / TRL s/step: {statistics.median(values):.2f}x{spread}")


if __name__ == "__main__":
    main()
