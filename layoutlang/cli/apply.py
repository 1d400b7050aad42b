"""``layoutlang apply``: run a reshard for real (local gloo workers or torchrun), plain or elastic."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._text import counted, human_bytes, rank_ranges, rank_span, table
from ..errors import ExitCode, LayoutValueError, ModelDescriptionError, did_you_mean
from ..io.output import MANIFEST, WrittenFile, check_room, read_manifest, why_not_removable, write_manifest
from ..io.safetensors import checkpoint_file, checkpoint_mismatches, tensors_from_safetensors
from ..lang import load
from ..model import Layout, Program, Reshard
from ..model.dtypes import DTYPES, canonical_dtype, itemsize
from . import arguments
from .apply_progress import Display
from .doctor import missing_for_run
from .json_output import emit, error_json
from .report import plan_mode_line
from .torchrun import environment_is_torchrun

if TYPE_CHECKING:
    from ..runtime.delta import DeltaOptions

HELP = "run a refit for real and verify every destination byte"
DESCRIPTION = (
    "Run the plan of a reshard statement. Launched by torchrun, every process joins the job "
    "as the program rank of its RANK; launched alone, one local worker process per rank of the "
    "reshard's meshes is started and joined over gloo. Sources hold synthetic weights (or the "
    "boxes of a safetensors checkpoint); every destination byte is compared with the source of truth."
)


#: ``--plan-mode``: what each rank compiles (the Resharder's ``per_rank``: None, False, True)
PLAN_MODES = ("auto", "fleet", "per-rank")
#: layoutlang.runtime.PER_RANK_PLAN_RANKS, written out for the help text: importing the runtime
#: imports torch, which the other commands start without (a test keeps the two equal)
PER_RANK_PLAN_RANKS = 1024
#: ``--source-policy`` / ``--destination-policy``: elastic.remesh.SESSION_POLICIES but
#: ``callback`` (a Python function, which a command line cannot give), written out because
#: importing elastic imports torch (a test keeps the two equal)
REMESH_POLICIES = ("drop-replica", "shrink-axis", "fill-spares", "await-rejoin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang apply``, plain and elastic."""
    arguments.add_file(parser)
    arguments.add_reshard(parser)
    arguments.add_policy(parser)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the gather-and-broadcast plan and compare (each policy runs at least twice and reports its "
        "fastest: a first run pays for setting up connections); refused into a destination that stores tensors "
        "quantized, which only the reshard policy refits",
    )
    parser.add_argument(
        "--plan-mode",
        choices=PLAN_MODES,
        default="auto",
        help="the plan each rank compiles: per-rank (its own part of the pairwise plan; time and memory grow "
        "with what the rank moves), fleet (the whole fleet's plan on every rank), or auto (the default, as "
        f"the Resharder's: per-rank when the reshard's meshes hold at least {PER_RANK_PLAN_RANKS:,} ranks "
        "together and every tensor reshards, else fleet); gather-and-broadcast always runs the fleet plan",
    )
    parser.add_argument(
        "--from", dest="from_dir", metavar="DIR", help="read source weights from a safetensors checkpoint"
    )
    parser.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="with --from: follow the files an index names outside its folder (absolute paths, '..', "
        "symbolic links leaving it) and a model.safetensors or index that links outside it; refused by default",
    )
    parser.add_argument(
        "--to",
        dest="to_dir",
        metavar="DIR",
        help="write each destination rank's storages to DIR/rankNNNNN.safetensors (each file atomically); "
        "a folder holding an earlier run's files is refused without --overwrite",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --to: remove first the files an earlier layoutlang run wrote there (listed in the folder's "
        ".layoutlang-manifest.json and unchanged); any other rank file or model.safetensors* is refused by name, "
        "and so is a disk without room for this run, before anything is removed",
    )
    parser.add_argument(
        "--memory-budget",
        metavar="SIZE",
        type=arguments.memory_size,
        default=512 * 2**20,
        help="staging memory per rank (default 512MiB; buckets are half of it)",
    )
    parser.add_argument(
        "--timeout",
        type=arguments.seconds,
        default=300.0,
        metavar="S",
        help="seconds to wait for a peer (default 300; finite, above 0, at most a week)",
    )
    parser.add_argument(
        "--cast",
        type=_torch_dtype_name,
        metavar="DTYPE",
        help="destination dtype, converted on arrival: the language's name (bf16) or torch's (bfloat16)",
    )
    parser.add_argument(
        "--cast-sources",
        action="store_true",
        help="with --from: accept checkpoint tensors stored in another dtype than the source layout's "
        "(fp32 master weights for a bf16 layout), converted to the layout's dtype while packed",
    )
    parser.add_argument(
        "--repeat", type=arguments.positive_count, default=1, metavar="N", help="run N times and report the fastest"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="under torchrun: where storages live")
    parser.add_argument(
        "--transport",
        choices=("torch", "nccl"),
        default="torch",
        help="torch.distributed point-to-point (gloo on CPU, NCCL on GPU), or layoutlang's native NCCL core",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="run the workers as Ray actors: on the cluster RAY_ADDRESS names, else on a local one started "
        "(and shut down) here; without a topology block in the program, a Ray node is a domain "
        "(docs: tutorials/refit-ray)",
    )
    deltas = parser.add_argument_group(
        "delta refits",
        "With --delta, the refit runs --steps times; before each refit after the first, a synthetic "
        "training step changes --change-fraction of the source elements, and each message carries only "
        "what changed since the version its receiver holds (docs: guides/delta-refits).",
    )
    deltas.add_argument("--delta", action="store_true", help="send only what changed since the previous refit")
    deltas.add_argument(
        "--delta-digests", action="store_true",
        help="with --delta: senders keep a digest per 4 KiB block of what they sent instead of a copy "
        "(8 bytes per block); the blocks that changed travel whole",
    )
    deltas.add_argument(
        "--delta-budget", type=arguments.memory_size, default=None, metavar="SIZE",
        help="with --delta: the copies a sender keeps at most (e.g. 1GiB); messages past it keep digests, "
        "their changed blocks sent whole (default: no bound)",
    )
    deltas.add_argument(
        "--delta-place", default=None, metavar="DIR",
        help="with --delta: keep the senders' copies in memory-mapped files in this directory, not in "
        "memory (deleted as they are made)",
    )
    deltas.add_argument(
        "--change-fraction", type=arguments.fraction, default=None, metavar="F",
        help="with --delta: the fraction of source elements each training step changes (default 0.01)",
    )
    elastic = parser.add_argument_group(
        "elastic refits",
        "With --elastic, the refit runs --steps times in an elastic session: ranks that fail are "
        "excluded, the layouts are remeshed, and the refit goes on without restarting anyone "
        "(docs: guides/failure-recovery).",
    )
    elastic.add_argument(
        "--elastic", action="store_true", help="repeated refits that survive rank loss and replacement"
    )
    elastic.add_argument(
        "--steps", type=arguments.positive_count, default=None, metavar="N",
        help="refits to run, with --elastic or --delta (default 4)",
    )
    elastic.add_argument(
        "--kill",
        action="append",
        default=[],
        type=_rank_at_step,
        metavar="RANK@STEP",
        help="SIGKILL RANK halfway through the transfer of refit STEP (repeatable)",
    )
    elastic.add_argument(
        "--stop",
        action="append",
        default=[],
        type=_rank_at_step,
        metavar="RANK@STEP",
        help="SIGSTOP RANK halfway through refit STEP: a hung rank, excluded after about two deadlines",
    )
    elastic.add_argument(
        "--replace", action="store_true", help="start a replacement rank for every rank killed or stopped"
    )
    elastic.add_argument(
        "--deadline",
        type=arguments.seconds,
        default=1.0,
        metavar="S",
        help="seconds of silence after which a rank counts as failed (default 1)",
    )
    elastic.add_argument(
        "--source-policy",
        type=arguments.choice_of(REMESH_POLICIES, "remesh policy"),
        default="drop-replica",
        metavar="POLICY",
        help=f"remesh policy of the source layout when it loses ranks: {', '.join(REMESH_POLICIES)} "
        "(default drop-replica)",
    )
    elastic.add_argument(
        "--destination-policy",
        type=arguments.choice_of(REMESH_POLICIES, "remesh policy"),
        default="drop-replica",
        metavar="POLICY",
        help="remesh policy of the destination layout (default drop-replica; shrink-axis needs --destination-axis)",
    )
    elastic.add_argument("--source-axis", metavar="AXIS", help="the axis the source policy shrinks")
    elastic.add_argument("--destination-axis", metavar="AXIS", help="the axis the destination policy shrinks")


def _torch_dtype_name(text: str) -> str:
    """torch's name of a dtype given in any spelling the language knows (``bf16``, ``bfloat16``)."""
    short = canonical_dtype(text)
    if short is None:
        known = ", ".join(f"{name} ({torch_name})" for name, (_, torch_name) in DTYPES.items())
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (known: {known})")
    return DTYPES[short][1]


def check_checkpoint(
    program: Program,
    reshard: str | None,
    from_dir: str,
    cast_sources: bool = False,
    allow_outside_paths: bool = False,
) -> None:
    """Refuse a ``--from`` checkpoint that lacks a tensor of the source layout, or stores one with
    another dtype or shape: every such tensor at once, from the headers, before a worker starts.

    Every header is validated on the way (:mod:`layoutlang.io.safetensors`: spans of exactly
    shape x dtype, no overlap, index files inside the folder unless ``allow_outside_paths``).
    With ``cast_sources`` another dtype is accepted (the workers convert it while packing);
    without it, the error says how to ask for that when only dtypes differ."""
    statement = program.reshard(reshard)
    source = program.layout(statement.source)
    expected = [(name, source.tensors[name].shape, source.tensors[name].dtype) for name in source.resolved.names]
    stored = {
        name: (tuple(shape), dtype)
        for name, shape, dtype in tensors_from_safetensors(from_dir, allow_outside_paths=allow_outside_paths)
    }
    # only the dtype differs: what --cast-sources converts
    recast = [
        name
        for name, shape, dtype in expected
        if name in stored and stored[name][0] == tuple(shape) and stored[name][1] != dtype
    ]
    if cast_sources:
        expected = [(name, shape, stored[name][1] if name in recast else dtype) for name, shape, dtype in expected]
    problems, hint = checkpoint_mismatches(from_dir, expected, allow_outside_paths=allow_outside_paths)
    if problems and recast and not cast_sources:
        advice = (
            f"pass --cast-sources to convert the {len(recast)} tensor{'s' if len(recast) != 1 else ''} stored in"
            " another dtype to the layout's while packing them (as torch's .to() does)"
        )
        hint = f"{hint}; {advice}" if hint else advice
    if problems:
        listed = "\n".join(f"  {line}" for line in problems)
        raise ModelDescriptionError(
            f"{checkpoint_file(from_dir)}: the checkpoint does not hold the source layout '{source.name}' as the"
            f" program declares it ({len(problems)} of its {len(expected)} tensors):\n{listed}",
            hint=hint,
        )


#: the files an earlier run leaves in a ``--to`` folder: rank files, a whole checkpoint
#: (model.safetensors, its shards and index), and the temporary files of an interrupted write
_RUN_FILE = re.compile(
    r"rank\d+\.safetensors|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|\.rank\d+\.safetensors\..*\.tmp"
)
#: a temporary file of write_safetensors that an interrupted run left: partial bytes under a
#: name only its mkstemp makes, never in a manifest, and never anyone's output
_INTERRUPTED_WRITE = re.compile(r"\.rank\d+\.safetensors\.[A-Za-z0-9_]+\.tmp")


def prepare_output_folder(
    to_dir: str, *, overwrite: bool = False, from_dir: str | None = None, will_write: int = 0
) -> list[str]:
    """Make ``--to`` ready before a worker starts: created if missing, writable, with room for
    the ``will_write`` bytes the run writes, and holding no earlier run's files (rank files,
    ``model.safetensors*``) unless ``overwrite``, which removes them first, so the folder never
    mixes two runs' files. Returns the names removed.

    ``overwrite`` removes only what a layoutlang run wrote there: the files its manifest
    (:mod:`layoutlang.io.output`) lists and that still match it, and the temporary files of an
    interrupted write. Any other such file (a ``model.safetensors`` layoutlang did not write,
    a rank file changed since) is refused by name, and then nothing is removed; so is a disk
    without room for the run, even once the earlier files are gone.

    Every refusal is a :class:`~layoutlang.errors.LayoutValueError` naming the folder: a file in
    its place, a folder that cannot be created or written (read-only), the ``--from`` folder
    itself, an earlier run's files, files not written by layoutlang, a disk without room."""
    folder = Path(to_dir)
    if from_dir is not None and folder.resolve() == checkpoint_file(from_dir).parent.resolve():
        raise LayoutValueError(f"--to {folder}: is the folder of the --from checkpoint; write to another folder")
    if folder.exists() and not folder.is_dir():
        raise LayoutValueError(f"--to {folder}: is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # the one sure test of writability (root ignores permission bits; a mount may be read-only)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".layoutlang-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what = "create" if not folder.is_dir() else "write into"
        raise LayoutValueError(f"--to {folder}: cannot {what} the folder: {exc.strerror or exc}") from None
    earlier = sorted(entry.name for entry in os.scandir(folder) if _RUN_FILE.fullmatch(entry.name))
    if not earlier:
        check_room(folder, will_write)
        return []
    if not overwrite:
        shown = ", ".join(earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
        raise LayoutValueError(
            f"--to {folder}: the folder holds {len(earlier)} file{'s' if len(earlier) != 1 else ''} of an earlier"
            f" run ({shown})",
            hint="pass --overwrite to remove them before this run writes its own, or choose an empty folder",
        )
    manifest = read_manifest(folder)
    checked = [(name, why_not_removable(folder, name, manifest.get(name))) for name in earlier]
    refused = [(name, why) for name, why in checked if why is not None and not _INTERRUPTED_WRITE.fullmatch(name)]
    if refused:
        listed = "\n".join(f"  {name} {why}" for name, why in refused[:10])
        more = f"\n  and {len(refused) - 10} more" if len(refused) > 10 else ""
        raise LayoutValueError(
            f"--to {folder}: --overwrite removes only the files a layoutlang run wrote there (listed in its "
            f"{MANIFEST}, unchanged); {len(refused)} file{'s' if len(refused) != 1 else ''} of the folder "
            f"{'are' if len(refused) != 1 else 'is'} not, so nothing was removed:\n{listed}{more}",
            hint="move those files away yourself if they may go, or write to another folder",
        )
    check_room(folder, will_write, freed=sum(_size_of(folder / name) for name in earlier))
    try:
        for name in earlier:
            (folder / name).unlink(missing_ok=True)  # missing: another torchrun process removed it first
    except OSError as exc:
        raise LayoutValueError(f"--to {folder}: cannot remove {exc.filename}: {exc.strerror or exc}") from None
    # the manifest stays until this run replaces it: another process of a torchrun job may
    # still be checking the same files against it
    return earlier


def _size_of(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def bytes_to_write(program: Program, reshard: str | None, cast: str | None, ranks: Iterable[int] | None = None) -> int:
    """About the bytes the destination ranks (``ranks`` among them; all when None) write into
    ``--to``: their storages in the destination dtype (``cast``, a torch name, else the logical
    one; an fp8 destination counted at its logical dtype, so the estimate is never short),
    and a header of each file."""
    destination = program.layout(program.reshard(reshard).destination)
    wanted = None if ranks is None else set(ranks)
    cast_size = itemsize(canonical_dtype(cast) or "fp32") if cast else None
    total = 0
    for rank in destination.mesh.ranks:
        if wanted is not None and rank not in wanted:
            continue
        storages = destination.storages_on(rank)
        total += _HEADER_BYTES + _HEADER_BYTES_PER_TENSOR * len(storages)
        for name, shape in storages.items():
            elements = math.prod(shape)
            if elements:
                size = cast_size or itemsize(destination.tensors[destination.storage(name, rank).parts[0]].dtype)
                total += elements * size
    return total


#: a rank file's header, over-estimated: its length, metadata, and each tensor's entry
_HEADER_BYTES = 1024
_HEADER_BYTES_PER_TENSOR = 256


def _this_nodes_ranks() -> range | None:
    """The ranks torchrun started on this node (its default: consecutive, LOCAL_RANK 0 first),
    whose files this node's ``--to`` folder gets; None for a local launch (every rank)."""
    if not environment_is_torchrun():
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    return range(rank - local, rank - local + int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))


def record_output(to_dir: str, reports: Iterable[dict[str, Any]]) -> None:
    """Write the ``--to`` folder's manifest: the files the ranks wrote (their reports say
    each file's name, size and SHA-256), so that a later ``--overwrite`` may remove them."""
    files = [
        WrittenFile(**run["written"])
        for report in reports
        for run in report.get("runs", {}).values()
        if "written" in run
    ]
    write_manifest(to_dir, files)


def _rank_at_step(text: str) -> tuple[int, int]:
    rank, at, step = text.partition("@")
    if not at or not rank.strip().isdigit() or not step.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK@STEP (e.g. 5@1), not {text!r}")
    return int(rank), int(step)


#: The most worker processes the local launcher starts (one per rank, all on this machine,
#: each importing torch: a few hundred MB apiece); a larger job runs under torchrun.
MAX_LOCAL_WORKERS = 64


def _check_processes(args: argparse.Namespace, replacements: int = 0) -> None:
    """Refuse, before torch is imported and any process starts or joins a group, a job of the
    wrong size: under torchrun, a WORLD_SIZE smaller than the reshard's ranks (a process per
    rank, RANK = program rank; a missing rank would leave its peers waiting on a process that
    does not exist); launched alone, more workers than one machine runs (ranks 0 to the
    reshard's highest, and the replacements)."""
    statement, source, destination = _reshard_of(args, checked=True)
    ranks = {*source.mesh.ranks, *destination.mesh.ranks}
    processes = max(ranks) + 1
    if environment_is_torchrun():
        world = os.environ["WORLD_SIZE"]
        if not world.isdigit() or int(world) < processes:
            raise LayoutValueError(
                f"{args.file}: reshard '{statement.name}' needs {processes:,} processes (its meshes hold ranks "
                f"{rank_ranges(sorted(ranks))}, one process per rank), but torchrun started {world} "
                "(WORLD_SIZE); nothing was started",
                hint=f"start {processes:,} processes in all: nodes x --nproc-per-node = {processes:,}",
            )
        return
    if args.ray:  # the Ray cluster's resources bound it: RayWorkers says when they do not suffice
        return
    processes += replacements
    if processes > MAX_LOCAL_WORKERS:
        raise LayoutValueError(
            f"{args.file}: the reshard needs {processes:,} worker processes (one per rank); the local launcher "
            f"starts at most {MAX_LOCAL_WORKERS} on one machine",
            hint="run it under torchrun, one process per rank across the hosts (the refit tutorial's step 7)",
        )


def _delta_of(args: argparse.Namespace) -> DeltaOptions | bool:
    """What ``--delta`` and its options ask of every rank (False without ``--delta``)."""
    # The runtime imports torch: here, so that the light commands start without it.
    from ..runtime.delta import DeltaOptions

    if not args.delta:
        return False
    return DeltaOptions(
        keep="digests" if args.delta_digests else "copies",
        budget=args.delta_budget,
        place="host" if args.delta_place is None else args.delta_place,
    )


def _check_delta_options(args: argparse.Namespace) -> None:
    """Refuse what ``--delta`` does not combine with, and ``--steps`` / ``--change-fraction``
    without the mode that reads them; fill in their defaults."""
    if args.steps is not None and not (args.elastic or args.delta):
        raise LayoutValueError("--steps counts the refits of --elastic or --delta; give one of them")
    for flag, given in (("--delta-digests", args.delta_digests), ("--delta-budget", args.delta_budget is not None),
                        ("--delta-place", args.delta_place is not None)):
        if given and not args.delta:
            raise LayoutValueError(f"{flag} says what --delta senders keep; give --delta")
    if args.delta_place is not None and not os.path.isdir(args.delta_place):
        raise LayoutValueError(f"--delta-place {args.delta_place}: not a directory (the senders' copies go there)")
    if args.change_fraction is not None and not args.delta:
        raise LayoutValueError("--change-fraction is the share of elements a --delta step changes; give --delta")
    if args.delta:
        refused = [
            flag
            for flag, given in (
                ("--repeat", args.repeat != 1),  # a repeat of the same weights is a delta of nothing
                ("--transport nccl", args.transport == "nccl"),  # NCCL needs equal counts at both ends
            )
            if given
        ]
        if refused:
            raise LayoutValueError(f"--delta does not take {', '.join(refused)}",
                                   hint="delta refits run on torch.distributed with gloo; --steps N repeats them")
    args.steps = 4 if args.steps is None else args.steps
    args.change_fraction = 0.01 if args.change_fraction is None else args.change_fraction


def check_device(args: argparse.Namespace) -> None:
    """Refuse ``--device cuda`` / ``--transport nccl`` on a machine without what they need,
    found by the doctor's own detection, before torch.distributed starts and any worker runs;
    and ``--device cuda`` without torchrun (the local launcher's workers hold storages on CPU)."""
    asked = [
        flag
        for flag, given in (("--device cuda", args.device == "cuda"), ("--transport nccl", args.transport == "nccl"))
        if given
    ]
    if not asked:
        return
    missing = missing_for_run(args.device, args.transport)
    if missing:
        raise LayoutValueError(
            f"{' and '.join(asked)}: this machine has {'; '.join(missing)} (as `layoutlang doctor` reports)",
            hint="run `layoutlang doctor` to see what was looked for and where; without a GPU, leave out "
            + " and ".join(asked)
            + " (storages on CPU, gloo)",
        )
    if args.device == "cuda" and not environment_is_torchrun():
        raise LayoutValueError(
            "--device cuda: the local launcher's workers hold their storages on CPU (gloo); storages on CUDA "
            "devices need torchrun, one process per GPU",
            hint="torchrun --nproc-per-node N -m layoutlang.cli apply FILE --device cuda",
        )


def _check_ray(args: argparse.Namespace) -> None:
    """Refuse ``--ray`` where it cannot run, before anything starts: under torchrun (every
    process is already a rank), without Ray installed."""
    if environment_is_torchrun():
        raise LayoutValueError(
            "--ray starts the workers as Ray actors, but torchrun already started this process as a rank",
            hint="run `layoutlang apply --ray FILE` alone, or drop --ray under torchrun",
        )
    if importlib.util.find_spec("ray") is None:
        raise LayoutValueError("--ray: Ray is not installed", hint="pip install 'layoutlang[ray]'")
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:  # refused in one line before the progress display's header
        # ray_job imports ray and torch: only --ray needs them
        from .ray_job import check_address

        check_address(address)


def _check_broadcast_baseline(args: argparse.Namespace) -> None:
    """Refuse, before any worker starts, a gather-and-broadcast run (``--compare`` or
    ``--policy broadcast``) into a destination that stores tensors quantized: it gathers and
    broadcasts them in bf16, and nothing would quantize them."""
    _, _, destination = _reshard_of(args, checked=True)
    quantized = destination.quantized()
    if not quantized:
        return
    flag = "--compare" if args.compare else "--policy broadcast"
    first = next(iter(quantized))
    raise LayoutValueError(
        f"{flag} runs gather-and-broadcast, which cannot refit layout '{destination.name}': it stores "
        f"{counted(len(quantized), 'tensor')} quantized ('{first}', ...), which only the reshard policy refits",
        hint="run without " + flag + "; `layoutlang simulate` prices both, quantized and not",
    )


def run(args: argparse.Namespace) -> int:
    _check_delta_options(args)
    if args.ray:
        _check_ray(args)
    if args.elastic:
        return _apply_elastic(args)
    check_device(args)
    _check_processes(args)
    if args.kill or args.stop or args.replace:
        raise LayoutValueError("--kill, --stop and --replace need --elastic")
    if args.cast_sources and not args.from_dir:
        raise LayoutValueError("--cast-sources converts the tensors of a --from checkpoint; give --from DIR")
    if args.allow_outside_paths and not args.from_dir:
        raise LayoutValueError("--allow-outside-paths is about the index of a --from checkpoint; give --from DIR")
    if args.overwrite and not args.to_dir:
        raise LayoutValueError("--overwrite replaces the files of a --to folder; give --to DIR")
    if args.compare or args.policy == "broadcast":
        _check_broadcast_baseline(args)
    if args.plan_mode == "per-rank":
        # before any worker starts: every rank would fail to compile its part, in the agreement
        program = load(args.file, allow_outside_includes=args.allow_outside_includes)
        program.check()
        arguments.check_per_rank(program, args.reshard, args.policy, "--plan-mode per-rank")
    if args.from_dir or args.to_dir:
        # before torch is imported and any worker starts: a wrong checkpoint or --to folder fails in
        # well under a second; the program is checked first, so a bad one leaves the folder untouched
        program = load(args.file, allow_outside_includes=args.allow_outside_includes)
        program.check()
        program.reshard(args.reshard)
        if args.from_dir:
            check_checkpoint(program, args.reshard, args.from_dir, args.cast_sources, args.allow_outside_paths)
        if args.to_dir:
            # under torchrun every process checks here, before any joins the job: none has written yet
            will_write = bytes_to_write(program, args.reshard, args.cast, _this_nodes_ranks())
            prepare_output_folder(args.to_dir, overwrite=args.overwrite, from_dir=args.from_dir, will_write=will_write)

    # On a terminal, the header and a status line from the first second (before torch is
    # imported here and the workers start); plain lines otherwise; nothing with --json.
    display = Display("off") if environment_is_torchrun() else Display.for_command(args.json)
    if display.active:
        display.start(_progress_header(args, "Ray actors" if args.ray else "local gloo workers"), "starting workers")
    try:
        return _apply_plain(args, display)
    finally:
        display.close()


def _apply_plain(args: argparse.Namespace, display: Display) -> int:
    # The jobs import torch: here, so that the other commands start without it.
    from . import apply_job as job
    from .launch import WorkerError

    options = job.ApplyOptions(
        path=args.file,
        reshard=args.reshard,
        policy=args.policy,
        compare=args.compare,
        memory_budget=args.memory_budget,
        timeout=args.timeout,
        from_dir=args.from_dir,
        to_dir=args.to_dir,
        cast=args.cast,
        cast_sources=args.cast_sources,
        allow_outside_paths=args.allow_outside_paths,
        allow_outside_includes=args.allow_outside_includes,
        repeat=args.repeat,
        transport=args.transport,
        plan_mode=args.plan_mode,
        delta=_delta_of(args),
        steps=args.steps if args.delta else 1,
        change_fraction=args.change_fraction,
    )
    if environment_is_torchrun():
        reports = job.run_torchrun(options, args.device)
        if reports is None:
            return ExitCode.OK
        launcher = "torchrun"
    else:
        # a bad program fails here, before any process starts
        job.participants_of(args.file, args.reshard, allow_outside_includes=args.allow_outside_includes)
        try:
            if args.ray:
                # Ray and the Ray actors' pool import torch and ray: only --ray needs them
                from .ray_job import run_ray

                reports, launcher = run_ray(options, display)
            else:
                reports, launcher = job.run_local(options, display), "local gloo workers"
        except WorkerError as err:
            display.close()  # the status line goes before the error is printed
            if err.exit_code == ExitCode.INTERNAL:
                raise  # a bug: main reports it (exit 3), without a traceback
            # A user's mistake (exit 2) or a failure at run time (exit 1) found on a worker:
            # its message already has its place and caret.
            if args.json:
                return emit("apply", None, err.exit_code, [error_json(err.kind, err.message)])
            else:
                print(err.message, file=sys.stderr)
            return err.exit_code
    display.close()
    if args.to_dir:
        record_output(args.to_dir, reports)
    summary = plan_modes_shown(args, job.summarize(reports))
    if args.json:
        return emit("apply", summary, ExitCode.OK if summary["ok"] else ExitCode.FAILURE, job.failures(summary))
    else:
        print("\n".join(_apply_report(args, summary, launcher)))
    return ExitCode.OK if summary["ok"] else ExitCode.FAILURE


def plan_modes_shown(args: argparse.Namespace, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as reported: each run's ``plan_mode`` and ``plan_moves`` when ``--plan-mode``
    was given or a run's plans were not the whole fleet's (per-rank plans chosen by default);
    a default run of fleet plans is reported as before plan modes existed."""
    runs = summary["runs"].values()
    if args.plan_mode != "auto" or any(run["plan_mode"] != "fleet" for run in runs):
        return summary
    plain = {
        name: {k: v for k, v in run.items() if k not in ("plan_mode", "plan_moves")}
        for name, run in summary["runs"].items()
    }
    return summary | {"runs": plain}


def _progress_header(args: argparse.Namespace, launcher: str, replacements: int = 0) -> str:
    """The first line of the progress display: the reshard, and the workers starting."""
    statement, source, destination = _reshard_of(args)
    ranks = {*source.mesh.ranks, *destination.mesh.ranks}
    # plain: one worker per rank of the reshard; elastic: ranks 0 to its highest, and the replacements
    workers = max(ranks) + 1 + replacements if args.elastic else len(ranks)
    kind = f"elastic refit {statement.name}" if args.elastic else f"refit {statement.name}"
    steps = f", {args.steps} steps" if args.elastic else ""
    return (
        f"{kind}: {source.name} ({source.mesh.size} ranks) -> {destination.name} ({destination.mesh.size} ranks)"
        f"{steps}; starting {workers} {launcher}"
    )


def _apply_elastic(args: argparse.Namespace) -> int:
    replacements = len(args.kill) + len(args.stop) if args.replace else 0
    _check_processes(args, replacements)
    refused = [
        flag
        for flag, given in (
            ("--compare", args.compare),
            ("--from", args.from_dir),
            ("--to", args.to_dir),
            ("--cast", args.cast),
            ("--cast-sources", args.cast_sources),
            ("--allow-outside-paths", args.allow_outside_paths),
            # the elastic workers read the program as it is confined
            ("--allow-outside-includes", args.allow_outside_includes),
            ("--overwrite", args.overwrite),
            ("--policy", args.policy),
            ("--repeat", args.repeat != 1),
            ("--transport nccl", args.transport == "nccl"),
            ("--device cuda", args.device == "cuda"),
            (f"--plan-mode {args.plan_mode}", args.plan_mode != "auto"),
        )
        if given
    ]
    if refused:
        raise LayoutValueError(f"--elastic runs repeated verified refits; it does not take {', '.join(refused)}")
    _, source, destination = _reshard_of(args)  # a bad program failed in _check_processes, before any process
    participants = sorted({*source.mesh.ranks, *destination.mesh.ranks})
    _check_remesh_axes(args)
    faults = [(r, s, "kill") for r, s in args.kill] + [(r, s, "stop") for r, s in args.stop]
    for rank, step, how in faults:
        if rank not in participants:
            raise LayoutValueError(
                f"--{how} {rank}@{step}: rank {rank} is in no mesh of the reshard "
                f"(its ranks: {rank_span(participants)})"
            )
        if step >= args.steps:
            raise LayoutValueError(f"--{how} {rank}@{step}: there are only {args.steps} steps (0..{args.steps - 1})")
    display = Display("off") if environment_is_torchrun() else Display.for_command(args.json)
    if display.active:
        launcher = "Ray actors" if args.ray else "local gloo workers"
        display.start(_progress_header(args, launcher, replacements), "starting workers")
    try:
        return _run_elastic(args, faults, display)
    finally:
        display.close()


def _run_elastic(args: argparse.Namespace, faults: list[tuple[int, int, str]], display: Display) -> int:
    # The jobs import torch: here, so that the other commands start without it.
    from . import elastic_job as job

    options = job.ElasticOptions(
        path=args.file,
        steps=args.steps,
        reshard=args.reshard,
        faults=tuple(faults),
        replace=args.replace,
        memory_budget=args.memory_budget,
        timeout=min(args.timeout, 120.0),
        deadline=args.deadline,
        source_policy=args.source_policy,
        destination_policy=args.destination_policy,
        source_axis=args.source_axis,
        destination_axis=args.destination_axis,
        delta=_delta_of(args),
        change_fraction=args.change_fraction if args.delta else None,
    )
    if environment_is_torchrun():
        summary = job.run_torchrun(options, namespace=f"apply-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}")
        if summary is None:
            return ExitCode.OK
        launcher = "torchrun"
    elif args.ray:
        # Ray and the Ray actors' pool import torch and ray: only --ray needs them
        from .ray_job import run_ray_elastic

        summary, launcher = run_ray_elastic(options, display=display)
    else:
        summary = job.run_local(options, display=display)
        launcher = "local gloo workers"
    display.close()
    if any(e["kind"] == "internal" for e in summary["errors"].values()):
        status = ExitCode.INTERNAL
    else:
        status = ExitCode.OK if summary["ok"] else ExitCode.FAILURE
    if args.json:
        return emit("apply", summary, status, job.failures(summary, args.steps) if status else [])
    print("\n".join(_elastic_report(args, summary, launcher)))
    return status


def _check_remesh_axes(args: argparse.Namespace) -> None:
    """Refuse, before any process starts, what each side's remesh policy would only find at the
    first fault (turning a recoverable loss into a failed job): ``shrink-axis`` without its
    axis, and an axis the side's mesh does not have."""
    _, source, destination = _reshard_of(args)
    for side, layout, policy, axis in (
        ("source", source, args.source_policy, args.source_axis),
        ("destination", destination, args.destination_policy, args.destination_axis),
    ):
        axes = layout.mesh.axis_names
        if policy == "shrink-axis" and axis is None:
            raise LayoutValueError(
                f"--{side}-policy shrink-axis: name the axis it shrinks with --{side}-axis "
                f"(axes of mesh '{layout.mesh.name}': {', '.join(axes)})"
            )
        if axis is not None and axis not in axes:
            hint = did_you_mean(axis, axes)
            raise LayoutValueError(
                f"--{side}-axis {axis}: the {side} layout '{layout.name}' is on mesh '{layout.mesh.name}', whose axes "
                f"are {', '.join(axes)}",
                hint=hint,
            )


def _reshard_of(args: argparse.Namespace, checked: bool = False) -> tuple[Reshard, Layout, Layout]:
    """The reshard statement a report describes, and its source and destination layouts
    (``checked``: the whole program checked first, so that its first error is the one reported)."""
    program = load(args.file, allow_outside_includes=args.allow_outside_includes)
    if checked:
        program.check()
    statement = program.reshard(args.reshard)
    return statement, program.layout(statement.source), program.layout(statement.destination)


def _elastic_report(args: argparse.Namespace, summary: dict, launcher: str) -> list[str]:
    statement, source, destination = _reshard_of(args)
    head = (
        f"elastic refit {statement.name}: {source.name} ({source.mesh.size} ranks) -> {destination.name} "
        f"({destination.mesh.size} ranks), {args.steps} steps, "
        f"{len(summary['participants']) + len(summary['joiners'])} processes ({launcher})"
    )
    lines = [head]
    # by the step each fault was injected at, then by rank: faults of one step race each other
    step_of = {int(rank): step for rank, step in [*args.kill, *args.stop]}
    for rank, fault in sorted(summary["failed"].items(), key=lambda kv: (step_of.get(int(kv[0]), 0), int(kv[0]))):
        lines.append(f"  rank {rank}: {'SIGSTOP' if fault['how'] == 'stop' else 'SIGKILL'} (injected)")
    lines.append("")
    rows = []
    for step in summary["steps"]:
        verified = "ok" if not step["mismatches"] else f"{len(step['mismatches'])} MISMATCHES"
        wire = [human_bytes(step.get("wire_bytes", 0)), human_bytes(step.get("dense_bytes", 0))] if args.delta else []
        rows.append(
            [
                step["step"],
                step["generation"],
                step["destination"],
                step["ranks"],
                *wire,
                f"{verified} ({human_bytes(step['verified_bytes'])})",
            ]
        )
    if rows:
        header = ["step", "generation", "destination layout", "ranks",
                  *(["on the wire", "dense"] if args.delta else []), "verified"]
        lines += table(rows, header, right={0, 1, 3, 4, 5} if args.delta else {0, 1, 3})
    for recovery in summary["recoveries"]:
        lines += ["", *_recovery_lines(recovery, summary["joined"])]
    for rank in sorted(summary.get("not_admitted", {}), key=int):
        lines += ["", f"replacement rank {rank} was not admitted: the job's last step committed before it could join"]
    for rank, error in sorted(summary["errors"].items()):
        lines += ["", f"rank {rank}: {error['message']}"]
        break  # every survivor reports the same error
    if summary["ok"]:
        final = (
            f"all {args.steps} refits committed and verified; final generation {summary['generation']}: "
            f"{summary['source']} -> {summary['destination']}, members {rank_ranges(summary['members'])}"
        )
        lines += ["", final]
    return lines


_RECOVERY_TIMES = (
    ("noticed_s", "noticed by the first survivor"),
    ("agreed_s", "members agreed"),
    ("group_s", "new group built"),
    ("first_byte_s", "first byte moved on the new group"),
)


def _recovery_lines(rec: dict[str, Any], joined: dict[str, Any]) -> list[str]:
    """One recovery's timeline: who was lost or joined, when each phase ended, what moved."""
    what = []
    if rec["lost"]:
        what.append(f"lost {', '.join(map(str, rec['lost']))}")
    if rec["joined"]:
        what.append(f"joined {', '.join(map(str, rec['joined']))}")
    lines = [f"generation {rec['generation']} ({'; '.join(what)}), times from the {rec['from']}:"]
    for key, label in _RECOVERY_TIMES:
        if rec[key] is not None:
            lines.append(f"  {rec[key]:7.3f} s  {label}")
    for rank, why in sorted(rec["reasons"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"           rank {rank}: {why}")
    if rec["recovered_bytes"]:
        lines.append(f"  recovery plan: {human_bytes(rec['recovered_bytes'])} from surviving replicas")
    for rank in rec["joined"]:
        got = joined.get(str(rank))
        if got:
            verdict = "ok" if got["ok"] else f"{len(got['mismatches'])} MISMATCHES"
            lines.append(
                f"  rank {rank} received step {got['step']}'s weights: {verdict} ({human_bytes(got['bytes'])})"
            )
    return lines


def _delta_lines(policy: str, steps: list[dict], args: argparse.Namespace) -> list[str]:
    """A delta run's steps: what changed, what travelled against dense, how it was encoded,
    and where the senders keep the previous versions."""
    rows = []
    for step in steps:
        wire, dense = step["wire_bytes"], step["dense_bytes"]
        encodings = ", ".join(f"{k} {v}" for k, v in step["messages"].items() if v)
        rows.append([
            str(step["step"]),
            "-" if step["step"] == 0 else f"{step['changed_fraction']:.4%}",
            f"{step['seconds']:.3f} s",
            human_bytes(wire),
            human_bytes(dense),
            f"{dense / wire:.1f}x" if wire else "-",
            encodings or "-",
            "ok" if not step["mismatches"] else f"{step['mismatches']} MISMATCHES",
        ])
    header = ["step", "changed", "time", "on the wire", "dense", "fewer", "messages", "verified"]
    kept = max(step["kept_bytes_per_rank"] for step in steps)
    stale = sorted({name for step in steps for name in step["stale"]})
    lines = [f"{policy}: delta refits (step 0 is dense: no receiver holds a version yet)"]
    lines += table(rows, header, right={1, 2, 3, 4, 5})
    kept_as = "digests per 4 KiB block" if args.delta_digests else "copies"
    kept_as += " in host memory" if args.delta_place is None else f" in memory-mapped files in {args.delta_place}"
    if args.delta_budget is not None and not args.delta_digests:
        kept_as += f", up to {human_bytes(args.delta_budget)} per rank (digests past it)"
    lines.append(f"previous versions kept on the senders: {kept_as}; {human_bytes(kept)} per rank at most")
    if stale:
        lines.append(f"received dense (their bytes were not the version received last): {', '.join(stale)}")
    return lines


def _apply_report(args: argparse.Namespace, summary: dict, launcher: str) -> list[str]:
    statement, source, destination = _reshard_of(args)
    head = (
        f"refit {statement.name}: {source.name} ({source.mesh.size} ranks) -> {destination.name} "
        f"({destination.mesh.size} ranks), {summary['ranks']} processes ({launcher})"
    )
    # the plans each policy ran, when plan_modes_shown() kept them
    modes = all("plan_mode" in run for run in summary["runs"].values())
    lines = [head]
    if modes:
        lines += [f"  {policy}: {plan_mode_line(run)}" for policy, run in summary["runs"].items()]
    lines.append("")
    rows = []
    for policy, run in summary["runs"].items():
        verified = "ok" if not run["mismatches"] else f"{len(run['mismatches'])} MISMATCHES"
        rows.append(
            [
                policy,
                *([run["plan_mode"]] if modes else []),
                f"{run['seconds']:.3f} s",
                human_bytes(run["bytes"]["local"]),
                human_bytes(run["bytes"]["domain"]),
                human_bytes(run["bytes"]["network"]),
                human_bytes(run["moved_bytes"]),
                f"{run['messages']:,}",
                f"{human_bytes(run['bandwidth_bytes_per_second'])}/s",
                f"{human_bytes(run['peak_staging_bytes'])}",
                f"{verified} ({human_bytes(run['verified_bytes'])})",
            ]
        )
    header = ["policy", "time", "local", "domain", "network", "moved", "messages", "bandwidth", "peak staging"]
    header = [*header[:1], *(["plan"] if modes else []), *header[1:], "verified"]
    lines += table(rows, header, right=set(range(2 if modes else 1, len(header) - 1)))
    runs = summary["runs"]
    if "reshard" in runs and "broadcast" in runs:
        r, b = runs["reshard"], runs["broadcast"]
        lines.append("")
        lines.append(
            f"gather-and-broadcast took {b['seconds'] / max(r['seconds'], 1e-9):.1f}x the time of reshard and moved "
            f"{b['moved_bytes'] / max(r['moved_bytes'], 1):.1f}x its bytes "
            f"({_times(b['bytes']['network'], r['bytes']['network'])} over the network)"
        )
    if any("delta_steps" in run for run in runs.values()):
        lines.append("(time: the fastest delta refit; moved: the plan's bytes, which a dense refit sends)")
    for policy, run in runs.items():
        if "delta_steps" in run:
            lines += ["", *_delta_lines(policy, run["delta_steps"], args)]
    for run in runs.values():
        for mismatch in run["mismatches"][:10]:
            lines.append(f"MISMATCH {mismatch}")
    if args.to_dir:
        lines.append(f"destination storages written to {args.to_dir}/rankNNNNN.safetensors")
    return lines


def _times(a: int, b: int) -> str:
    """``a`` as a multiple of ``b`` ("1.0x" when both are 0, "infx" when only ``b`` is, as
    ``plan`` says it)."""
    if not b:
        return "1.0x" if not a else "infx"
    return f"{a / b:.1f}x"
