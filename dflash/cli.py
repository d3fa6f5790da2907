"""`dflash` command line. Exit codes: 0 done, 1 failure, 2 bad input, 3-6 the failure classes of dflash/runtime/failures.py."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from dflash.errors import BadInput, DflashError
from dflash.runtime.failures import EXIT_CODES, classify, describe

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2
SUITE_MAX_NEW_TOKENS = 256  # `dflash eval --suite`'s new tokens per prompt unless --max-new-tokens says


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash", description="Train DFlash speculative-decoding drafters.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a drafter from a YAML run config")
    t.add_argument("config", help="YAML run config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optim.lr=3e-4")
    t.add_argument("--check", action="store_true",
                   help="validate the config and the GPUs it asks for (in this environment) and exit")
    t.add_argument("--check-data", action="store_true",
                   help="with --check: also read every row of data.train_path / data.eval_path as training would")

    d = sub.add_parser("doctor", help="report torch/CUDA/GPUs/NCCL and the hybrid-kernel fast path")
    d.add_argument("--require-fast-path", action="store_true", help="exit 1 unless the fast kernels run")
    d.add_argument("--json", action="store_true", help="machine-readable output")

    e = sub.add_parser("export", help="export a checkpoint for serving engines")
    e.add_argument("checkpoint", help="run dir or checkpoints dir (its best checkpoint by real acceptance length "
                   "where the run kept one, else the newest), or a step-N dir")
    e.add_argument("out", nargs="?", help="new output directory")
    e.add_argument("--check", action="store_true", help="check an exported directory (the positional argument) "
                   "against what the serving engines' loaders read, without exporting (docs/serving.md)")
    e.add_argument("--latest", action="store_true", help="a run's newest checkpoint, not its best")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])

    v = sub.add_parser("eval", help="real speculative decoding with the target and a drafter: acceptance length, "
                       "speedup, losslessness")
    v.add_argument("config", help="the run's YAML config (target, tokenizer, held-out data)")
    v.add_argument("drafter", help="run dir or checkpoints dir (its best checkpoint by real acceptance length "
                   "where the run kept one, else the newest), a step-N dir or an export dir")
    v.add_argument("overrides", nargs="*", help="key.path=value overrides of the config")
    v.add_argument("--latest", action="store_true", help="a run's newest checkpoint, not its best")
    v.add_argument("--prompts", help="chat JSONL of prompts (default: the run's held-out split)")
    v.add_argument("--num-prompts", type=int, default=32)
    v.add_argument("--max-new-tokens", type=int,
                   help="new tokens per prompt, decoding stops at EOS before (default: what the run's evals decode, "
                   "eval.max_new_tokens or the regenerated answers' limit; with --suite: 256)")
    v.add_argument("--thinking", choices=["keep", "strip", "disable", "on", "off"], default="keep",
                   help="on/off: render the prompts with enable_thinking=True/False (Qwen3-class templates; "
                   "disable = off); keep: the template's default")
    v.add_argument("--suite", action="append", metavar="NAME[=PATH][,NAME[=PATH]]",
                   help="benchmark prompt sets (gsm8k, math500, humaneval, mbpp, mtbench, alpaca): NAME alone reads "
                   "the installed package that ships it (all: the five packaged suites), NAME=PATH a local "
                   "JSONL/JSON/parquet file in the published format or hf:DATASET_ID[@CONFIG][:SPLIT]: a "
                   "per-suite table (docs/evaluation.md); repeatable")
    v.add_argument("--suite-limit", type=int, default=80, help="with --suite: the first N rows of each suite")
    v.add_argument("--no-prompt-lookup", action="store_true",
                   help="with --suite: skip the prompt-lookup baseline (transformers' prompt-lookup decoding)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.add_argument("--out", help="also write the JSON report to this file")

    g = sub.add_parser("target", help="real targets shipped in installed packages: convert one into a model "
                       "directory for target.path (`packaged:NAME` in a config converts it by itself)")
    g.add_argument("action", choices=["convert", "list"])
    g.add_argument("name", nargs="?", help="the packaged target (dflash target list)")
    g.add_argument("--force", action="store_true", help="convert again even if the directory exists")

    # Parsed by dflash.ops.cli (its own options and exit codes); listed here for --help.
    sub.add_parser("ops", help="train/status/stop/logs of the training containers through ansible-runner",
                   add_help=False)

    s = sub.add_parser("synth-data", help="write a JSONL file of the synthetic counting language")
    s.add_argument("out")
    s.add_argument("--num-samples", type=int, default=2000)
    s.add_argument("--num-words", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)

    from dflash.regenerate.cliargs import add_arguments as add_regenerate_arguments

    add_regenerate_arguments(sub.add_parser(
        "regenerate", help="answer a chat JSONL's prompts with the target itself (training data, docs/regenerate.md)"))

    q = sub.add_parser("prompt-pool", help="write training prompts from installed packages' data sets, none a copy "
                       "of an eval suite's row (docs/evaluation.md)")
    q.add_argument("out", help="the chat JSONL to write (a summary goes to OUT.summary.json)")
    q.add_argument("--max-rows", type=int, help="keep the first N rows (tasks are dealt round-robin)")
    q.add_argument("--held-out", type=int, default=0, metavar="N",
                   help="write the first N rows (a balanced sample) to --held-out-to instead: the run's held-out prompts")
    q.add_argument("--held-out-to", metavar="FILE", help="with --held-out: the held-out prompts' JSONL (data.eval_path)")
    q.add_argument("--per-task", type=int, help="at most N rows of each task")
    q.add_argument("--seed", type=int, default=0, help="shuffles each task's rows")
    q.add_argument("--tasks", help="comma-separated task names or patterns (minerva_math_*); default: all whose "
                   "licence is permissive")
    q.add_argument("--share-alike", action="store_true", help="also the CC-BY-SA tasks (the pool then carries "
                   "their share-alike terms)")
    return p


def _cmd_train(args) -> int:
    from dflash.config import load_config

    _convert_packaged(args.config, args.overrides)
    config = load_config(args.config, args.overrides)
    if args.check:
        _check_devices(config)
        checked = _check_data(config) if args.check_data else []
        print(f"config OK: {args.config}" + "".join(f"; data OK: {path} ({rows} rows)" for path, rows in checked))
        return EXIT_OK
    from dflash.launch import run_training

    return run_training(config, args.config, args.overrides)


def _check_devices(config) -> None:
    """The GPUs the run asks for exist here (runtime.device cuda, topology GPU ids, CUDA_VISIBLE_DEVICES): the
    refusal the trainer would give at its start, given before a deploy touches the running job."""
    if config.runtime.device == "cpu":
        return  # nothing to look for (and no torch import)
    from dflash.runtime.topology import check_devices, plan_ranks

    check_devices(config, plan_ranks(config.topology))


def _check_data(config) -> list[tuple[str, int]]:
    """Read the run's JSONL files with the trainer's own reader: a bad row is the BadInput training would hit."""
    from dflash.data.chat import read_jsonl

    d = config.data
    paths = ([d.train_path] if d.train_path and d.synthetic is None else []) + ([d.eval_path] if d.eval_path else [])
    return [(path, len(read_jsonl(path))) for path in paths]


def _cmd_doctor(args) -> int:
    from dflash.runtime import doctor

    info = doctor.collect()
    print(json.dumps(info, indent=2) if args.json else doctor.render(info))
    if args.require_fast_path and not info["fast_path"]:
        print("dflash: error: the hybrid-target fast path is not available (see above); install "
              "flash-linear-attention and causal-conv1d", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_export(args) -> int:
    from dflash.components.export import choose_checkpoint, export

    if args.check:
        from dflash.components.export import check_serving

        if args.out is not None:
            raise BadInput("dflash export --check takes one directory (an export); drop the second argument")
        warnings = check_serving(args.checkpoint)
        for w in warnings:
            if w.rule == "llama.cpp":
                print(f"note: {w}")
        print(f"serving check passed: {args.checkpoint} ({len(warnings)} warning(s))")
        return EXIT_OK
    if args.out is None:
        raise BadInput("dflash export needs an output directory: dflash export RUN_OR_CHECKPOINT OUT")
    src, why = choose_checkpoint(args.checkpoint, "latest" if args.latest else "best")
    out = export(src, args.out, args.dtype)
    print(f"exported drafter {src} ({why}) to {out} (serving check passed)")
    return EXIT_OK


def _cmd_eval(args) -> int:
    from dflash.evaluation.evaluate import run_eval

    if args.num_prompts < 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        raise BadInput("--num-prompts and --max-new-tokens must be >= 1")
    _convert_packaged(args.config, args.overrides)
    if args.suite:
        from dflash.evaluation.suites import run_suites

        if args.max_new_tokens is None:  # benchmark prompts, not the run's: their own default
            args.max_new_tokens = SUITE_MAX_NEW_TOKENS
        if args.latest:  # the suites take the drafter directory as given (a run's best, else its newest)
            from dflash.components.export import resolve_checkpoint

            args.drafter = str(resolve_checkpoint(args.drafter, "latest"))
        return run_suites(args)
    return run_eval(args.config, args.drafter, args.overrides, latest=args.latest, prompts_file=args.prompts,
                    num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, as_json=args.json,
                    out=args.out, thinking=args.thinking)


def _cmd_target(args) -> int:
    from dflash.models.packaged_target import convert, converted
    from dflash.packaged import PACKAGED_TARGETS, target_cache_dir

    if args.action == "list":
        for name, t in PACKAGED_TARGETS.items():
            state = "converted" if converted(name) else "not converted"
            print(f"{name}: {t.model}, {t.model_licence}; from {t.package}=={t.distribution.version}; {state}: "
                  f"{target_cache_dir(name)}")
        return EXIT_OK
    if not args.name:
        raise BadInput(f"dflash target convert NAME: name one of {', '.join(PACKAGED_TARGETS)}")

    directory = convert(args.name, force=args.force)
    print(f"{args.name}: {directory}  (in a run config: target.path: packaged:{args.name})")
    return EXIT_OK


def _convert_packaged(config_path: str | None, overrides: list[str]) -> None:
    """A config naming `packaged:NAME` gets its target converted before it is read (once; cached)."""
    from dflash.models.packaged_target import convert_named_in_config

    convert_named_in_config(config_path, overrides)


def _cmd_synth(args) -> int:
    from dflash.data.synthetic import generate_conversations, write_jsonl

    rows = generate_conversations(args.num_samples, args.num_words, 16, 48, [1, 2], args.seed)
    print(f"wrote {len(rows)} samples to {write_jsonl(args.out, rows)}")
    return EXIT_OK


def _cmd_regenerate(args) -> int:
    from dflash.regenerate.runner import run_regenerate

    if args.target_config:
        _convert_packaged(args.target_config, [])
    from dflash.packaged import packaged_name

    if packaged_name(args.target_path):  # --target-path packaged:NAME: the converted directory
        from dflash.models.packaged_target import convert

        args.target_path = str(convert(packaged_name(args.target_path)))
    return run_regenerate(args)


def _cmd_prompt_pool(args) -> int:
    from dflash.data.prompt_pool import render, write_pool

    tasks = args.tasks.split(",") if args.tasks else None
    summary = write_pool(args.out, seed=args.seed, per_task=args.per_task, max_rows=args.max_rows, tasks=tasks,
                         share_alike=args.share_alike, held_out=args.held_out, held_out_path=args.held_out_to)
    print(render(summary))
    return EXIT_OK


def _is_override(arg: str) -> bool:
    """A `key.path=value` override (not an option, not a stray word)."""
    return not arg.startswith("-") and "=" in arg


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ops"]:
        from dflash.ops.cli import main as ops_main

        return ops_main(argv[1:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after the options apply like those before them; anything else is refused
        if args.command in ("train", "eval") and all(_is_override(a) for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = {"train": _cmd_train, "doctor": _cmd_doctor, "export": _cmd_export, "eval": _cmd_eval,
               "synth-data": _cmd_synth, "regenerate": _cmd_regenerate,
               "prompt-pool": _cmd_prompt_pool, "target": _cmd_target}
    try:
        return handler[args.command](args)
    except BadInput as exc:  # bad input (2) or, of a dataset, a data error (3)
        print(f"dflash: error: {exc}", file=sys.stderr)
        return EXIT_CODES[classify(exc)]
    except DflashError as exc:  # a failure the message explains (e.g. speculative decoding not lossless)
        print(f"dflash: error: {exc}", file=sys.stderr)
        return EXIT_CODES.get(getattr(exc, "failure_class", None), EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception as exc:
        traceback.print_exc()
        cls = classify(exc)  # out of memory, a collective timeout, a GPU error: their own exit codes
        if cls != "unknown":
            print(f"dflash: error: {describe(cls, exc)}", file=sys.stderr)
        return EXIT_CODES[cls]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
