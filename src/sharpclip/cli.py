"""The `sharpclip` command: one subcommand per job, each a thin call into the library (no logic of its own).

Each subcommand is added by one `_add_<name>` function; its handler imports what it needs lazily so that
`sharpclip --help` stays fast. sharpclip's own errors (bad config, bad sample, checkpoint, run directory, export,
a diverged run, a missing or unwritable file) end the command with one line on stderr and exit status 2; the
traceback is printed only with `--debug` (before or after the subcommand) or SHARPCLIP_DEBUG=1.

`key=value` overrides may stand anywhere after the subcommand, before or after its flags (`train --resume RUN
train.epochs=3`). Every command prints sharpclip's log messages (INFO and up, from every part: data, models,
training) on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path


def path_arg(text: str) -> str:
    """The type of every path flag and argument: `~` and `~user` expanded, as a shell expands a word's leading `~`
    but not the one after `--flag=` (the test walks every subcommand's parser for flags without it)."""
    return os.path.expanduser(text)


def positive_int(text: str) -> int:
    """An integer >= 1 (`-k 0` and `-k -5` are refused by argparse with a usage line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _config_args(p: argparse.ArgumentParser, example: str = "train.lr=1e-4") -> None:
    p.add_argument(
        "config_args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
        help=f"YAML recipes, layered in order, then dotted overrides (e.g. {example}); before or after the flags",
    )  # fmt: skip
    p.set_defaults(words_dest="config_args")


def _load(args: argparse.Namespace, extra: list[str] | None = None):
    from sharpclip.config import load_config, split_args

    files, overrides = split_args(args.config_args)
    return load_config(files, overrides + (extra or []))


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved, validated config (YAML + dotted overrides)")
    _config_args(p)
    p.add_argument("--explain", metavar="KEY", help="print what KEY does, its type and default (a prefix such as "
                   "`train` lists its keys) instead of the config; docs/config.md lists them all")  # fmt: skip
    p.add_argument("--memory", action="store_true", help="print the per-rank memory plan (parameters, gradients, "
                   "optimiser, activations per row) instead of the config; docs/gpus.md#memory-plan")  # fmt: skip
    p.add_argument("--gpu-memory", metavar="SIZE", help="with --memory (which each of these flags implies): the GPU's "
                   "memory (80GiB, 141GB): prints the largest micro-batch that fits")  # fmt: skip
    p.add_argument("--world-size", type=int, default=None, metavar="N", help="with --memory: the number of ranks "
                   "(default 1)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="N", help="with --memory: ranks per node, for "
                   "train.layout=hybrid (default: min(world size, 8))")  # fmt: skip
    p.add_argument("--arch", type=path_arg, default="", metavar="NAME",
                   help="with --memory: the architecture when model.name is not on this machine: an open_clip "
                   "config name (ViT-L-14, ViT-bigG-14, ...) or a model config JSON")  # fmt: skip
    p.add_argument("--measure", action="store_true", help="with --memory: measure activations by a forward and "
                   "backward of 1 and 2 rows of a randomly initialised copy on train.device (else: "
                   "estimated)")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        if args.explain:  # the schema's own text: nothing heavy imported
            from sharpclip.config_reference import explain

            print(explain(args.explain), end="")
            return 0
        from sharpclip.config import to_yaml
        from sharpclip.train.run import check_config, check_world

        cfg = _load(args)
        objective = check_config(cfg)  # what `train` refuses before it builds anything, refused here too
        plan_flags = (args.gpu_memory, args.arch, args.measure, args.gpus_per_node, args.world_size is not None)
        if args.memory or any(plan_flags):  # a plan's flag asks for the plan (matrix 6 M5)
            from sharpclip.train.memory_plan import print_plan

            world = 1 if args.world_size is None else args.world_size
            per_node = args.gpus_per_node or min(world, 8)
            if world >= 1 and per_node >= 1:  # (print_plan refuses the others in its own words)
                check_world(cfg, objective, world, per_node)  # the plan refuses what training refuses (M4)
            print_plan(cfg, args.arch, world, per_node, args.gpu_memory, args.measure)
            return 0
        print(f"# objective: {objective!r}")  # the terms the loss sums, a merge made visible (YAML reads a comment)
        print(to_yaml(cfg), end="")
        return 0

    p.set_defaults(handler=run)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="fine-tune a model (any recipe of both papers; torchrun for several processes)",
        epilog="Settings are key=value words (train.lr=1e-4 data.root=DIR model.name=RUN_OR_MODEL): `sharpclip config "
        "--explain train` lists a section's keys, `sharpclip config --explain KEY` explains one (also other tools' "
        "names: train.learning_rate, train.wd); docs/config.md lists them all.",
    )  # fmt: skip
    _config_args(p, "loss.terms.hn.params.gamma=0.25")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", type=path_arg, metavar="RUN",
                      help="continue a run exactly, writing into RUN (a run directory, or RUN/checkpoints/step-N); "
                      "key=value overrides may change the schedule and cadence; `auto`: start train.output_dir, or "
                      "continue the run it holds (a cluster job's command)")  # fmt: skip
    mode.add_argument("--overwrite", action="store_true", help="empty a non-empty train.output_dir and start over")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.config import split_args
        from sharpclip.train.auto_resume import AUTO, decide
        from sharpclip.train.resume import load_resume_config
        from sharpclip.train.run import AlreadyFinished, run_train
        from sharpclip.train.stop import STOPPED_EXIT, Stopped

        files, overrides = split_args(args.config_args)
        resume, overwrite = args.resume, args.overwrite
        if resume == "latest" and not Path(resume).exists():  # open_clip's spelling
            print("sharpclip train: --resume latest is open_clip's spelling: use --resume auto (continue the run in "
                  "train.output_dir, or start it) or --resume RUN", file=sys.stderr)  # fmt: skip
            return 2
        if resume == AUTO:  # start train.output_dir or continue the run it holds (train.auto_resume)
            start = decide(files, overrides)
            cfg, resume, overwrite = start.cfg, start.resume, start.overwrite
        else:  # with --resume: the recipe if given, else the run's own config.yaml, plus any new overrides
            cfg = load_resume_config(resume, files, overrides) if resume else _load(args)
        try:
            state = run_train(cfg, resume=resume, overwrite=overwrite)
        except AlreadyFinished as done:  # not an error: a requeued job may resume a run that has just finished
            summary = str(done)
        except Stopped as stopped:  # a stop signal: checkpoint written, the run continues with --resume
            if int(os.environ.get("RANK", 0)) == 0:
                print(str(stopped))
            return STOPPED_EXIT
        else:
            summary = f"trained {state.step} steps ({state.seen} samples); run directory: {cfg.train.output_dir}"
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun: one summary, not one per rank
            print(summary)
        return 0

    p.set_defaults(handler=run)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="the tasks of a sweep file (fractions × objectives × seeds): list them, or print "
                       "one task's overrides for a SLURM array task (examples/slurm/sweep.sbatch)")  # fmt: skip
    p.add_argument("file", type=path_arg, metavar="SWEEP.yaml", help="root: and axes: (see examples/slurm/sweep.yaml)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--task", type=int, metavar="I", help="print task I's overrides, one a line (train.output_dir "
                       "last)")  # fmt: skip
    which.add_argument("--array-task", action="store_true", help="the same for the task $SLURM_ARRAY_TASK_ID names")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.sweep import read_sweep, task

        index = args.task
        if args.array_task:
            named = os.environ.get("SLURM_ARRAY_TASK_ID", "")
            if not named.isdigit():
                print(f"sharpclip sweep: --array-task: SLURM_ARRAY_TASK_ID is {named or 'not set'}: submit with "
                      "sbatch --array=0-N", file=sys.stderr)  # fmt: skip
                return 2
            index = int(named)
        try:
            if index is not None:
                print("\n".join(task(args.file, index).overrides))
                return 0
            root, tasks = read_sweep(args.file)
        except ValueError as err:
            print(f"sharpclip sweep: {err}", file=sys.stderr)
            return 2
        for t in tasks:
            print(f"{t.index}\t{t.name}\t{shlex.join(t.overrides)}")
        print(f"{len(tasks)} tasks into {root}/: sbatch --array=0-{len(tasks) - 1} examples/slurm/sweep.sbatch "
              f"{args.file} RECIPE.yaml ...")  # fmt: skip
        return 0

    p.set_defaults(handler=run)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the quickstart: every objective fine-tuned and compared on SynthDense, on CPU")
    p.add_argument(
        "--out", type=path_arg, default="runs/demo", help="run directory: data, runs, report.md, report.json, figures"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (about 1 minute; the CI end-to-end test)")
    p.add_argument("--full", action="store_true", help="add the ablations: frozen Ḡ, γ sweep, LoRA ± boost, scale")
    p.add_argument("--seeds", type=int, default=1, help="fine-tuning seeds per arm (mean ± spread when > 1)")
    p.add_argument("--cache", type=path_arg, default="",
                   help="where the pre-trained init is kept (default $SHARPCLIP_CACHE or "
                   "~/.cache/sharpclip)")  # fmt: skip
    p.add_argument("--arms", default="", help="comma-separated arms to run (InfoNCE always runs), e.g. hn,hn_frozen")
    p.add_argument("--steps", type=int, default=0, help="fine-tuning steps per arm instead of the mode's")
    p.add_argument("--set", dest="sizes", action="append", default=[], metavar="FIELD=VALUE",
                   help="change one size of the mode (demo.plan.Profile), e.g. lr=3e-4 or train_detail_pairs=0; "
                   "repeatable")  # fmt: skip
    p.add_argument("--task", default="paper-geometry", metavar="NAME",  # demo.plan.DEFAULT_TASK (imported lazily)
                   help="the target task (demo.plan.TASKS): paper-geometry (default) or unseen-details")  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(console_level=logging.WARNING)  # its own bar holds the terminal; each arm logs to its folder

    def run(args: argparse.Namespace) -> int:
        from sharpclip.demo import DemoOptions, profile_for, run_demo, select

        if args.seeds < 1 or args.steps < 0:
            print("sharpclip demo: --seeds must be >= 1 and --steps >= 0", file=sys.stderr)
            return 2
        only = tuple(a for a in args.arms.split(",") if a)
        opts = DemoOptions(args.out, args.quick, args.full, args.seeds, args.cache, args.progress, only, args.steps)
        opts.sizes, opts.task = tuple(args.sizes), args.task
        try:
            select(opts)
            profile_for(opts)
        except ValueError as err:
            print(f"sharpclip demo: {err}", file=sys.stderr)
            return 2
        run_demo(opts)
        return 0

    p.set_defaults(handler=run)


def _add_objectives(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("objectives", help="list the registered loss terms and the features their inputs may read")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.losses import registry
        from sharpclip.train.features import FEATURES, NEEDS

        for spec in registry.specs():
            params = ", ".join(f"{k}={v!r}" for k, v in spec.params.items()) or "-"
            inputs = ", ".join(spec.inputs + tuple(f"[{k}]" for k in spec.optional_inputs))
            print(f"{spec.name:16s} inputs: {inputs}\n{'':16s} params: {params}\n{'':16s} {spec.summary}")
        print("\nfeatures (what an input may read; loss.terms.<term>.inputs.<argument>: <feature>):")
        for f in FEATURES.values():
            needs = f"  [needs {NEEDS[f.needs].what}]" if f.needs else ""
            print(f"  {f.name:17s} {f.shape:13s} {f.doc}{needs}")
        return 0

    p.set_defaults(handler=run)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a transformers folder (AutoModel-loadable) and check it reloads exactly")
    p.add_argument(
        "source", type=path_arg, metavar="RUN_OR_CHECKPOINT", help="run directory, sharpclip checkpoint or HF folder"
    )
    p.add_argument("--to", type=path_arg, required=True, metavar="DIR", help="output folder")
    p.add_argument("--vision-only", action="store_true", help="export the vision tower alone (CLIPVisionModel)")
    p.add_argument("--best", action="store_true", help="a run directory's best checkpoint (best.json), not its newest")
    p.add_argument("--force", action="store_true", help="empty a non-empty --to folder first")
    p.add_argument("--license", default="", help="the model card's license (a Hub license id, e.g. mit); none if unset")
    p.add_argument("--base-model", default="", metavar="HUB_ID", help="the model card's base_model: the Hub id of "
                   "what the run fine-tuned (model.name is recorded as it is either way)")  # fmt: skip
    p.add_argument("--dataset", action="append", default=[], metavar="HUB_ID", help="a Hub dataset id for the card's "
                   "datasets (repeatable)")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        from sharpclip.model_card import CardOptions, model_card
        from sharpclip.models.export import ExportError, export_model
        from sharpclip.train.checkpoint import CheckpointError, resolve_source

        try:
            source = resolve_source(args.source, args.best)
            options = CardOptions(args.license, args.base_model, args.dataset)
            card = model_card(source, Path(args.to).name, options, args.vision_only)
            print(export_model(source, args.to, vision_only=args.vision_only, force=args.force, card=card))
        except (ExportError, CheckpointError, OSError, ValueError) as err:  # 1: no run or checkpoint, or not faithful
            print(f"sharpclip export: {' '.join(str(err).split())}", file=sys.stderr)
            return 1 if isinstance(err, ExportError | CheckpointError) else 2
        return 0

    p.set_defaults(handler=run)


def _add_blend(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blend", help="WiSE-FT: blend a fine-tuned model with its initialisation (one α, or a sweep)")
    p.add_argument(
        "init", type=path_arg, metavar="INIT", help="the initialisation the run started from (any model.name form)"
    )
    p.add_argument("finetuned", type=path_arg, metavar="FINETUNED", help="a run directory or one of its checkpoints")
    _config_args(p, "eval.data_root=/data/benchmarks (the suites --sweep evaluates)")
    p.add_argument(
        "--to", type=path_arg, required=True, metavar="DIR", help="output folder (must be empty unless --force)"
    )
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--alpha", type=float, help="θ = (1 − α)·θ_init + α·θ_finetuned, written as a checkpoint")
    how.add_argument("--sweep", metavar="A,B,…", help="evaluate these αs: trade-off curve and the best guarded α")
    p.add_argument("--target", default="", help="the metric --sweep maximises, SUITE/KEY (e.g. docci/mean_R@1)")
    p.add_argument("--guard", action="append", default=[], metavar="SUITE/KEY[:MAX_DROP]",
                   help="guarded metric (repeatable), e.g. zeroshot/top1:2.0: at most 2 points below INIT")  # fmt: skip
    p.add_argument("--best", action="store_true", help="a run directory's best checkpoint (best.json), not its newest")
    p.add_argument("--force", action="store_true", help="empty a non-empty --to folder first")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.wise_ft import parse_alphas, run_blend
        from sharpclip.eval.guards import parse_guard

        try:
            alphas = parse_alphas(args.sweep) if args.sweep else [args.alpha]
            guards = [parse_guard(g) for g in args.guard]
            written = run_blend(
                args.init, args.finetuned, args.to, _load(args), alphas, args.target, guards, args.best, args.force
            )
        except (OSError, ValueError, KeyError) as err:  # structure mismatch, unknown metric, non-empty --to
            print(f"sharpclip blend: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        print("\n".join(f"wrote {p}" for p in written))
        return 0

    p.set_defaults(handler=run)


def _add_distill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="distil the text tower into a RoPE text tower (CLIP-IN eq. 7 / TULIP)")
    _config_args(p, "model.name=/models/clip-vit-large-patch14; the model section names the teacher")
    p.add_argument(
        "--captions", type=path_arg, required=True, metavar="FILE", help="text file, one (long) caption per line"
    )
    p.add_argument(
        "--to", type=path_arg, required=True, metavar="DIR", help="where to write the student's sharpclip checkpoint"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="empty an earlier distillation's train.output_dir (its files only)"
    )

    def run(args: argparse.Namespace) -> int:
        from sharpclip.train.distill import run_distill

        summary = run_distill(_load(args), args.captions, args.to, overwrite=args.overwrite)  # settings: `train`
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun: one summary, not one per rank
            print(summary)
        return 0

    p.set_defaults(handler=run)


def _add_validate_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate-data", help="check a dataset: counts, bad samples, duplicates, token lengths")
    p.add_argument(
        "target", type=path_arg, metavar="CONFIG_OR_PATH", help="a YAML recipe (its data section) or a data folder/file"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides for a recipe, e.g. data.root=/data/docci")
    p.set_defaults(words_dest="overrides")
    p.add_argument("--format", help="the data format (default: the recipe's, or detected from the folder)")
    p.add_argument("--split", help="the split to check (default: the train split; test for test-only formats)")
    p.add_argument("--tokenizer", type=path_arg, help="a local HF tokenizer folder for exact token counts")
    p.add_argument("--json", type=path_arg, metavar="FILE", help="write the JSON report here instead of printing it")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")

    def run(args: argparse.Namespace) -> int:
        import json

        from sharpclip.data import validate as v
        from sharpclip.models.tokenizer import token_counter

        try:
            if args.json:  # a file there that sharpclip did not write is refused before the data is read
                from sharpclip import owned_files

                owned_files.check([args.json], "--json")
            cfg = v.config_for(args.target, args.overrides, args.format)
            counter, name = token_counter(cfg.format, args.tokenizer)
            report = v.validate(cfg, args.split or v.default_split(cfg), counter, name, progress=args.progress)
        except (OSError, ValueError) as err:  # no such folder, unknown split, unreadable annotation file
            print(f"sharpclip validate-data: {err}", file=sys.stderr)
            return 2
        print(report.summary())
        text = json.dumps(report.to_json(), indent=2)
        if args.json:
            owned_files.write_text(args.json, text + "\n", "--json")
        else:
            print(text)
        return 0 if report.ok else 1

    p.set_defaults(handler=run)


def _eval_config(args: argparse.Namespace, overrides: list[str], run_out: str | None, model: str | None = None):
    """A run directory's own resolved config (its data, for suite `retrieval`) when no recipe is given; else the
    recipes and overrides as usual."""
    from sharpclip.config import split_args
    from sharpclip.train.run import RESOLVED_CONFIG, load_run_config

    files, extra = split_args(args.config_args)
    if run_out is not None and not files and (Path(model) / RESOLVED_CONFIG).is_file():
        return load_run_config(model, extra + overrides)
    return _load(args, overrides)


def suite_names(text: str) -> list[str]:
    """`--suite a,,b` → ['a', 'b']: split on commas here, empty entries dropped; a name that is not a plain word
    (letters, digits, _ . -) is a one-line error rather than YAML's."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not re.fullmatch(r"[\w.-]+", n)]
    if bad or not names:
        raise ValueError(f"--suite {text!r}: {bad[0]!r} is not a suite name" if bad else f"--suite {text!r}: no suite")
    return names


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on benchmark suites: JSON + markdown report and eval manifest")
    _config_args(p, "eval.recall_k=[1,5,10]")
    p.add_argument("--model", type=path_arg, action="append", default=[],
                   help="model to evaluate (sets model.name): a run directory (its newest complete checkpoint), a "
                   "checkpoint, an HF or open_clip folder, or a tiny preset; repeat it for one table across models "
                   "(--table)")  # fmt: skip
    p.add_argument("--best", action="store_true", help="a run directory's best checkpoint (best.json), not its newest")
    p.add_argument("--suite", help="comma-separated suites, e.g. docci,urban1k,mmvp (sets eval.suites)")
    p.add_argument("--data-root", type=path_arg, help="folder holding one sub-folder per suite (sets eval.data_root)")
    p.add_argument("--out", type=path_arg, help="report folder (sets eval.output_dir); with several --model, each "
                   "model's report goes to OUT/<name>")  # fmt: skip
    p.add_argument("--table", type=path_arg, help="folder for one table across the models (eval_table.csv/.md, a "
                   "row per model; eval_table_detail.csv/.md per subset); default with several --model: --out, "
                   "else eval-table")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.study_table import report_settings
        from sharpclip.eval.suite import run_eval
        from sharpclip.eval.table import check_tables, read_report, short_labels, write_tables
        from sharpclip.train.checkpoint import CheckpointError, model_source

        several = len(args.model) > 1
        table = args.table or ((args.out or "eval-table") if several else None)
        try:
            if table:
                check_tables(table)  # a table file there sharpclip did not write: refused before evaluating
            plans = [_eval_plan(args, name, label, model_source) for name, label in
                     zip(args.model or [None], short_labels(args.model) or [""], strict=True)]  # fmt: skip
            reports, settings = [], []
            for label, cfg in plans:
                paths = run_eval(cfg)
                print(paths[1].read_text(), end="")
                print("\n".join(f"wrote {p}" for p in paths))
                reports.append((label, read_report(paths[0])))
                settings.append(report_settings(paths[0]) if table else {})
            if table:
                written = write_tables(reports, table, settings)
                print(written[1].read_text(), end="")
                print("\n".join(f"wrote {p}" for p in written))
        except (OSError, ValueError, CheckpointError) as err:  # no checkpoint, missing benchmark files, unknown suite
            print(f"sharpclip eval: {err}", file=sys.stderr)
            return 2
        return 0

    p.set_defaults(handler=run)


def _eval_plan(args: argparse.Namespace, name: str | None, label: str, model_source):
    """(row label, resolved config) of one `--model` of `sharpclip eval`: with several, each report goes to
    OUT/<label>, or to a run directory's own eval folder; another model without --out is refused."""
    model, run_out = model_source(name, args.best) if name else (None, None)
    out = args.out
    if len(args.model) > 1:
        out = str(Path(args.out) / label) if args.out else run_out
        if out is None:
            raise ValueError(f"--model {name}: not a run directory, so its report needs a folder: give --out DIR "
                             "(each model's report goes to DIR/<name>)")  # fmt: skip
        if args.out:  # DIR/<name>: folders sharpclip names, never written through a link (matrix 6 V4)
            from sharpclip.eval.report import check_report_folder

            check_report_folder(out, Path(args.out))
    if run_out and not out:  # <run>/eval/<checkpoint>: folders sharpclip names, never written through a link
        from sharpclip.eval.report import check_report_folder

        check_report_folder(run_out, Path(name).expanduser())
    flags = {"model.name": model, "eval.data_root": args.data_root, "eval.output_dir": out or run_out}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if args.suite:
        overrides.append(f"eval.suites=[{','.join(suite_names(args.suite))}]")
    return label or (name or ""), _eval_config(args, overrides, run_out, name)


def _add_eval_table(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-table", help="one table across finished evaluations: a row per model, the suites' "
                       "headline figures as columns (CSV + markdown), per-subset figures in a second; a long CSV "
                       "(a row per run, suite and metric, the run's settings as columns) and the runs grouped over "
                       "seeds (mean ± std, n)")  # fmt: skip
    p.add_argument("reports", nargs="+", type=path_arg, metavar="REPORT",
                   help="an eval_report.json, the folder holding one, or a run directory (its newest evaluated "
                   "checkpoint's report, RUN/eval/step-N/)")  # fmt: skip
    p.add_argument("--label", action="append", default=[], metavar="NAME",
                   help="row labels, in the order of the REPORTs (default: each one's last path part)")  # fmt: skip
    p.add_argument("--out", type=path_arg, default="eval-table", help="folder for eval_table.csv / .md and "
                   "eval_table_detail.csv / .md (default eval-table)")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.study_table import report_settings
        from sharpclip.eval.table import read_report, report_file, short_labels, write_tables

        if args.label and len(args.label) != len(args.reports):
            print(f"sharpclip eval-table: {len(args.label)} --label for {len(args.reports)} reports", file=sys.stderr)
            return 2
        names = [str(Path(r)).removesuffix("/eval_report.json") for r in args.reports]
        labels = args.label or short_labels(names)
        files = [report_file(r) for r in args.reports]
        reports = [(label, read_report(f)) for label, f in zip(labels, files, strict=True)]
        written = write_tables(reports, args.out, [report_settings(f) for f in files])
        print(written[1].read_text(), end="")
        print("\n".join(f"wrote {p}" for p in written))
        return 0

    p.set_defaults(handler=run)


ANALYSES = ("dynamics", "sample-efficiency", "geometry", "near-duplicates", "feature-map")


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="one subcommand per analysis: dynamics (Fig. 4, convergence), "
                       "sample-efficiency, geometry, near-duplicates (captions), feature-map")  # fmt: skip
    kinds = p.add_subparsers(dest="analysis", metavar="ANALYSIS")
    for add in (_add_analyze_dynamics, _add_analyze_sample_efficiency, _add_analyze_geometry,
                _add_analyze_near_duplicates, _add_analyze_feature_map):  # fmt: skip
        q = add(kinds)
        q.add_argument("--out", type=path_arg, default="figures", help="where the PNG, JSON and markdown files go")
        q.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _analyze_runs_parser(kinds: argparse._SubParsersAction, name: str, text: str, **kw) -> argparse.ArgumentParser:
    q = kinds.add_parser(name, help=text, description=text, **kw)
    q.add_argument("runs", type=path_arg, nargs="+", metavar="RUN", help="run directories of `sharpclip train`")
    return q


def _add_analyze_dynamics(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    q = _analyze_runs_parser(kinds, "dynamics", "finished runs: gradient dynamics (HN-CLIP Fig. 4, diagnostics.jsonl), "
                             "convergence (validation per epoch) and training curves (metrics.jsonl)",
                             aliases=["convergence"])  # fmt: skip
    q.add_argument("--metric", default="R@1", help="convergence metrics: keys ending in this (e.g. t2i/R@1)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.run import analyze_runs

        return _wrote(analyze_runs(args.runs, args.out, args.metric))

    q.set_defaults(handler=run)
    return q


def _add_analyze_sample_efficiency(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    q = _analyze_runs_parser(kinds, "sample-efficiency", "runs trained on subsets (data.train_fraction or "
                             "train_count): best validation metric against the training fraction, one line per "
                             "method (HN-CLIP Fig. 6, Table A9)")  # fmt: skip
    q.add_argument("--metric", default="mean_R@1", help="the validation key per run (default mean_R@1)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.run import analyze_sample_efficiency

        return _wrote(analyze_sample_efficiency(args.runs, args.out, args.metric))

    q.set_defaults(handler=run)
    return q


def _analyze_data_parser(kinds: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    """A caption analysis: the data as `eval` reads it (recipes, data.* overrides, --suite, --data-root)."""
    q = kinds.add_parser(name, help=text, description=text + ". Without --suite, the config's data section "
                         "(data.format, data.root, data.eval_split, data.caption_field...), as eval's suite "
                         "`retrieval`.")  # fmt: skip
    _config_args(q, "data.format=generic data.root=DIR data.eval_split=train data.caption_field=title")
    q.add_argument("--model", type=path_arg, help="the text encoder (sets model.name): a run directory, checkpoint, "
                   "HF or open_clip folder, or tiny preset")  # fmt: skip
    q.add_argument("--suite", help="comma-separated retrieval suites of `sharpclip eval` (sets eval.suites; default: "
                   "the config's data section)")  # fmt: skip
    q.add_argument("--data-root", type=path_arg, help="folder holding one sub-folder per suite (sets eval.data_root)")
    return q


def _caption_config(args: argparse.Namespace):
    overrides = [f"model.name={args.model}"] * bool(args.model)
    overrides += [f"eval.data_root={args.data_root}"] * bool(args.data_root)
    if args.suite:
        overrides.append(f"eval.suites=[{','.join(suite_names(args.suite))}]")
    return _load(args, overrides)


def _add_analyze_geometry(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    q = _analyze_data_parser(kinds, "geometry", "caption geometry under a text encoder (HN-CLIP Table A1, Fig. 1, "
                             "A5, A6) and the margin in logits beside the paper's")  # fmt: skip
    q.add_argument("--gamma", type=float, default=0.5, help="the γ whose margin is shown in logits")
    q.add_argument("--scale", type=float, default=0.0, help="the logit scale s of the margin in logits (default: "
                   "the model's own)")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.run import analyze_geometry
        from sharpclip.models.factory import create_model

        if args.gamma < 0 or args.scale < 0:
            raise ValueError("--gamma and --scale must be >= 0")
        cfg = _caption_config(args)
        written = analyze_geometry(create_model(cfg.model), cfg.eval, args.out, gamma=args.gamma,
                                   scale=args.scale or None, data=cfg.data)  # fmt: skip
        print((Path(args.out) / "caption_geometry.md").read_text(encoding="utf-8"))  # margin in logits too
        return _wrote(written)

    q.set_defaults(handler=run)
    return q


def _add_analyze_near_duplicates(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    q = _analyze_data_parser(kinds, "near-duplicates", "the caption pairs a text encoder finds most alike, and "
                             "typical ones, the words that differ marked (HN-CLIP Fig. A1–A4)")  # fmt: skip
    q.add_argument("--pairs", type=positive_int, default=20, help="pairs listed per suite and kind (default 20)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.run import analyze_near_duplicates
        from sharpclip.models.factory import create_model

        cfg = _caption_config(args)
        return _wrote(analyze_near_duplicates(create_model(cfg.model), cfg.eval, args.out, args.pairs, cfg.data))

    q.set_defaults(handler=run)
    return q


def _add_analyze_feature_map(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    text = "patch feature map of a caption over an image, one or two models side by side (CLIP-IN Fig. 3)"
    q = kinds.add_parser("feature-map", help=text, description=text)
    q.add_argument("image", type=path_arg, metavar="IMAGE", help="the image file")
    q.add_argument("--text", required=True, help="the caption every patch is scored against")
    q.add_argument("--model", type=path_arg, action="append", default=[], required=True,
                   help="once or twice: a run directory, checkpoint, HF folder or tiny preset")  # fmt: skip
    q.add_argument("--dense", choices=("maskclip", "value"), default="maskclip", help="the dense features: MaskCLIP's "
                   "(the block's residual and MLP kept) or the value path alone")  # fmt: skip

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.feature_map import check_outputs, load_models, run_feature_map

        check_outputs(Path(args.out))  # before any model is loaded
        return _wrote(run_feature_map(load_models(args.model), args.image, args.text, args.out, args.dense))

    q.set_defaults(handler=run)
    return q


def _wrote(paths: list[Path]) -> int:
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


# the old spelling of `analyze` (flags instead of a subcommand), kept for one release with a notice
_OLD_VALUE_FLAGS = ("--out", "--metric", "--geometry", "--model", "--data-root", "--feature-map", "--text", "--dense",
                    "--gamma", "--scale", "--pairs")  # fmt: skip


def _old_analyze_words(rest: list[str]) -> tuple[dict[str, list[str]], list[str]] | None:
    """The flags ({flag: [values]}) and positional RUNs of an old-style `analyze` command line; None when a word is
    not one of the old flags (argparse then says so)."""
    flags: dict[str, list[str]] = {}
    runs: list[str] = []
    words = iter(rest)
    for word in words:
        name, eq, value = word.partition("=")
        if name in _OLD_VALUE_FLAGS:
            flags.setdefault(name, []).append(value if eq else next(words, ""))
        elif word in ("--sample-efficiency", "--debug"):
            flags.setdefault(word, []).append("")
        elif word.startswith("-"):
            return None
        else:
            runs.append(word)
    return flags, runs


def old_analyze(argv: list[str]) -> list[list[str]] | None:
    """The new command lines for an `analyze` command line in the old spelling (`analyze --geometry SUITES`,
    `analyze RUN...`, `--sample-efficiency RUN...`, `--feature-map IMAGE`), else None (already new, or not analyze).
    `--geometry` becomes `geometry` then `near-duplicates` (it wrote both)."""
    i = next((k for k, w in enumerate(argv) if not w.startswith("-")), len(argv))
    if i == len(argv) or argv[i] != "analyze" or len(argv) == i + 1:
        return None
    rest = argv[i + 1 :]
    if rest[0] in (*ANALYSES, "convergence", "-h", "--help"):
        return None
    parsed = _old_analyze_words(rest)
    if parsed is None:
        return None
    flags, runs = parsed
    head = [*argv[:i], "analyze"]

    def carry(*names: str) -> list[str]:
        return [w for n in names for v in flags.get(n, []) for w in (n, v)]

    tail = carry("--out") + ["--debug"] * ("--debug" in flags)
    lines = []
    if "--sample-efficiency" in flags:
        given = flags.get("--metric", [])[-1:]
        metric = [w for m in given for w in ("--metric", "mean_R@1" if m == "R@1" else m)]
        lines.append([*head, "sample-efficiency", *runs, *metric, *tail])
    elif runs:
        lines.append([*head, "dynamics", *runs, *carry("--metric"), *tail])
    data = carry("--data-root") + [w for v in flags.get("--model", [])[:1] for w in ("--model", v)]
    for suites in flags.get("--geometry", []):
        lines.append([*head, "geometry", "--suite", suites, *data, *carry("--gamma", "--scale"), *tail])
        lines.append([*head, "near-duplicates", "--suite", suites, *data, *carry("--pairs"), *tail])
    for image in flags.get("--feature-map", []):
        text = carry("--text") or ["--text", ""]
        lines.append([*head, "feature-map", image, *text, *carry("--model", "--dense"), *tail])
    return lines


def _add_search(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="index a dataset or image folder with one or two models; query by text or image")
    _config_args(p, "data.format=generic data.root=/data/mine")
    p.add_argument("--model", type=path_arg, action="append", required=True, metavar="MODEL",
                   help="a run directory, checkpoint, export/HF folder or tiny model; twice: side by side")  # fmt: skip
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--images", type=path_arg, metavar="DIR", help="a folder of images (captions from same-named .txt files)"
    )
    what.add_argument("--suite", help="a retrieval suite of `sharpclip eval` (default: the config's data section)")
    p.add_argument("--data-root", type=path_arg, help="folder holding one sub-folder per suite (sets eval.data_root)")
    p.add_argument(
        "--index",
        type=path_arg,
        default="search-index",
        metavar="DIR",
        help="where indexes live: DIR/<data>-<digest>/<model>-<digest>/",
    )
    query = p.add_mutually_exclusive_group()
    query.add_argument("--text", help="query caption")
    query.add_argument("--image", type=path_arg, metavar="FILE", help="query image")
    p.add_argument("-k", "--top", type=positive_int, default=10, help="results per model (default 10)")
    p.add_argument(
        "--html", type=path_arg, metavar="FILE", help="also write an HTML page (thumbnails in FILE's folder)"
    )
    p.add_argument("--rebuild", action="store_true", help="delete and rebuild the indexes (only their own files)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis import search as s

        overrides = [f"eval.data_root={args.data_root}"] * bool(args.data_root)
        cfg = _load(args, overrides)
        if args.html:  # refused before any index is built or any file written
            s.Page(args.html, "", flag="--html").claim()
        if args.image is not None:
            s.check_query_image(args.image)
        dataset, spec = s.read_gallery(cfg, args.images, args.suite)
        if args.text is None and args.image is None:  # build (or resume) the indexes only
            for name in args.model:
                print(
                    f"index ready: {s.open_searcher(name, cfg, dataset, spec, args.index, args.rebuild).index.folder}"
                )
            return 0
        found = s.search(cfg, args.model, dataset, spec, args.index, args.text, args.image, args.top, args.rebuild)
        print(s.format_hits(found, dataset))
        if args.html:
            print(f"wrote {s.write_search_page(found, dataset, args.html, args.text, args.image)}")
        return 0

    p.set_defaults(handler=run)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two models' retrievals side by side: the queries whose ranks differ most")
    _config_args(p, "eval.data_root=/data/benchmarks")
    p.add_argument(
        "--model", type=path_arg, action="append", required=True, metavar="MODEL", help="twice: --model A --model B"
    )
    p.add_argument("--suite", help="a retrieval suite of `sharpclip eval` (default: the config's data section)")
    p.add_argument("--data-root", type=path_arg, help="folder holding one sub-folder per suite (sets eval.data_root)")
    p.add_argument(
        "--index", type=path_arg, default="search-index", metavar="DIR", help="where indexes live (shared with search)"
    )
    p.add_argument(
        "--out", type=path_arg, default="compare", help="folder for compare.html (+ thumbnails), compare.png, .json"
    )
    p.add_argument("-k", "--top", type=positive_int, default=5, help="images shown per model and query (default 5)")
    p.add_argument("-n", "--queries", type=positive_int, default=6, help="queries shown per direction (default 6)")
    p.add_argument("--rebuild", action="store_true", help="delete and rebuild the indexes (only their own files)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.analysis.compare import run_compare, totals_text

        cfg = _load(args, [f"eval.data_root={args.data_root}"] * bool(args.data_root))
        written, result = run_compare(
            cfg, args.model, args.suite, args.index, args.out, args.top, args.queries, args.rebuild
        )
        print(totals_text(result))
        print("\n".join(f"wrote {p}" for p in written))
        return 0

    p.set_defaults(handler=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharpclip",
        description="Fine-tune CLIP-style image-text models to tell near-duplicate images and captions apart.",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (or SHARPCLIP_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.add_argument("--version", action="version", version=f"sharpclip {_version()}")
    for add in (
        _add_config,
        _add_train,
        _add_objectives,
        _add_export,
        _add_blend,
        _add_distill,
        _add_validate_data,
        _add_eval,
        _add_eval_table,
        _add_analyze,
        _add_search,
        _add_compare,
        _add_sweep,
        _add_demo,
    ):
        add(sub)
    for command in sub.choices.values():  # `sharpclip train ... --debug` as well as `sharpclip --debug train ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _version() -> str:
    from sharpclip import __version__

    return __version__


def own_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are sharpclip's messages to the user (config, data, run directory, checkpoint, export,
    divergence, files): printed as one line. Anything else is a bug and keeps its traceback."""
    from sharpclip.data.schema import BadSampleError
    from sharpclip.models.export import ExportError
    from sharpclip.train.checkpoint import CheckpointError
    from sharpclip.train.failures import RankFailed
    from sharpclip.train.run_dir import RunDirError
    from sharpclip.train.trainer import TrainingDiverged

    return (ValueError, OSError, BadSampleError, CheckpointError, RunDirError, TrainingDiverged, ExportError,
            RankFailed)  # fmt: skip


def _quiet_rank(err: BaseException) -> bool:
    """A config error on a torchrun rank other than 0 (the same error, from the same words, that rank 0 prints), or
    a rank's failure, whose line the failing rank printed as it told the others (train.failures.RankFailed)."""
    from sharpclip.config import ConfigError
    from sharpclip.train.failures import RankFailed

    return isinstance(err, RankFailed) or (isinstance(err, ConfigError) and int(os.environ.get("RANK", 0) or 0) != 0)


def _describe(err: BaseException) -> str:
    from sharpclip.config import ConfigError

    kind = "config error: " if isinstance(err, ConfigError) else ""
    return kind + " ".join(str(err).split())


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args`, except that the subcommand's words (recipes, key=value overrides) may also follow its
    flags: argparse ends a positional list at the first flag, so the words after one come back as unknown; they are
    appended, in order, to the command's list (later overrides win, as before). Unknown flags stay an error."""
    args, extra = parser.parse_known_args(argv)
    dest = getattr(args, "words_dest", None)
    if extra and (dest is None or any(w.startswith("-") for w in extra)):
        if int(os.environ.get("RANK", 0) or 0) != 0:  # torchrun: rank 0 says it, from the same words
            raise SystemExit(2)
        hint = flag_hint(extra, list(sys.argv[1:] if argv is None else argv), args.command or "")
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if extra:
        setattr(args, dest, [*getattr(args, dest), *extra])
    return args


def flag_hint(unknown: list[str], words: list[str], command: str) -> str:
    """'; settings are key=value words: did you mean train.batch_size=8?' for the first `unknown` flag that names a
    setting (`--batch-size 8`, `--batch_size=8`, `--lr 1e-4`: open_clip's and transformers' habits), else ''.
    `words`: the whole command line, where the flag's value follows it."""
    from sharpclip.config import suggest_keys

    for flag in (w for w in unknown if w.startswith("--")):
        name, eq, value = flag[2:].partition("=")
        if not eq:  # the value is the next word, unless that is another flag or an override (a switch: true)
            i = words.index(flag) + 1 if flag in words else len(words)
            value = words[i] if i < len(words) and not words[i].startswith("-") and "=" not in words[i] else "true"
        keys = sorted(suggest_keys(name.replace("-", "_")), key=lambda k: not k.startswith(f"{command}."))
        if keys:  # the command's own section first (eval.batch_size for eval, train.batch_size for train)
            others = "".join(f" (or {k}={value})" for k in keys[1:2])
            return f"; settings are key=value words: did you mean {keys[0]}={value}{others}?"
    return ""


class _Console(logging.StreamHandler):
    """sharpclip's log on stderr during one command (rank 0: INFO and up; other ranks: errors, and the warnings
    marked `extra={"rank_own": True}`, which only that rank can see). While a bar draws on the terminal a line is
    written above it (tqdm.write, what tqdm's logging redirect does), never onto the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        from sharpclip.progress import showing

        if not showing():
            super().emit(record)
            return
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's own rule: a failing handler reports, never raises
            self.handleError(record)


class OtherRanks(logging.Filter):
    """On ranks other than 0: drop the warnings that every rank raises alike (rank 0 prints them once); errors and
    warnings marked `rank_own` pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or getattr(record, "rank_own", False)


def quiet_hub_bars() -> None:
    """transformers' and huggingface_hub's own bars ("Loading weights") off when stderr is not a terminal: in a
    redirected log they are streams of frames."""
    from sharpclip.progress import on_terminal

    if on_terminal():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by both when they are imported
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


@contextlib.contextmanager
def console_logging(level: int = logging.INFO):
    """Give every sharpclip logger (sharpclip.data, .models, .train, ...) a handler for the command's duration;
    without one, Python drops their INFO lines (unseen samples, skipped records) and prints warnings unformatted.
    `level` on rank 0 (other torchrun ranks: warnings only)."""
    from sharpclip.progress import TerminalOnly

    root = logging.getLogger("sharpclip")
    handler = _Console()
    handler.addFilter(TerminalOnly())  # training's progress lines stay off a terminal that shows the bar
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler.setLevel(level if int(os.environ.get("RANK", 0)) == 0 else max(level, logging.WARNING))
    if int(os.environ.get("RANK", 0)) != 0:
        handler.addFilter(OtherRanks())
    level = root.level
    root.setLevel(logging.INFO)  # setLevel, not `.level =`: it clears the loggers' cached isEnabledFor answers
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _run_old_analyze(lines: list[list[str]]) -> int:
    """Run the new spelling of an old-style `analyze` command line, after a one-line notice naming it."""
    if not lines:
        print(f"sharpclip analyze: give an analysis: sharpclip analyze {{{','.join(ANALYSES)}}} ... (see analyze "
              "--help)", file=sys.stderr)  # fmt: skip
        return 2
    new = " ; ".join("sharpclip " + shlex.join(line) for line in lines)
    print(f"sharpclip analyze: the flag spelling is deprecated and goes in the next release; running: {new}",
          file=sys.stderr)  # fmt: skip
    for line in lines:
        try:
            code = main(line)
        except SystemExit as stop:  # argparse's usage error (a missing RUN), as a return code like the old spelling's
            code = stop.code if isinstance(stop.code, int) else 2
        if code:
            return code
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    lines = old_analyze(words)
    if lines is not None:
        return _run_old_analyze(lines)
    parser = build_parser()
    args = parse_args(parser, argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("SHARPCLIP_DEBUG", "") not in ("", "0")
    quiet_hub_bars()
    try:
        if args.command == "train":  # srun's tasks without torchrun: RANK from SLURM_PROCID before anything reads it
            from sharpclip.train.slurm import adopt

            adopt()  # and a rank that srun did not start is refused at once (train.slurm.check_step)
        with console_logging(getattr(args, "console_level", logging.INFO)):
            return args.handler(args)
    except own_errors() as err:
        if _quiet_rank(err) and not debug:  # torchrun: every rank read the same config; rank 0 says it once
            return 2
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug for the traceback)"
        print(f"sharpclip {args.command}: {_describe(err)}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
