"""The steps every native DeepSpeed export takes, whatever files it writes.

A native export (the dense one, :mod:`ucformat.export.deepspeed_native`, and the MoE one,
:mod:`ucformat.export.deepspeed_experts`) goes into a DeepSpeed run folder:

1. a URL destination is written into a local staging folder, then uploaded
   (:mod:`ucformat.export.url_target`);
2. :func:`~ucformat.export.run_folder.plan_destination` decides the tag and checks the folder;
3. the target plans its files for that tag (pure: a dry run stops here);
4. DeepSpeed's classes are imported, the run folder is staged
   (:func:`~ucformat.export.run_folder.prepare_folder`), the target writes its files into the
   staged tag folder and ``latest`` beside it; the commit moves the tag folder in, ``latest``
   last, and removes the previous tag if that was asked for.

What differs between the targets (the plan, the files, the summary, the notes) comes in as a
:class:`NativeExport`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from ucformat.export.common import ExportHooks, ExportResult, Stopwatch
from ucformat.export.deepspeed_common import DeepSpeedClasses, deepspeed_classes
from ucformat.export.destination import write_bytes
from ucformat.export.native_target import NativeTarget
from ucformat.export.run_folder import (
    Destination,
    plan_destination,
    prepare_folder,
)
from ucformat.export.url_target import export_to_url, is_url
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.sources.deepspeed.files import LATEST_FILE

__all__ = ["NativeExport", "NativePlanLike", "run_native_export"]


class NativePlanLike(Protocol):
    """What the steps read of a target's plan."""

    @property
    def target(self) -> NativeTarget:
        """The job that will load the export (its ``tag`` names the tag folder)."""

    @property
    def files(self) -> tuple[str, ...]:
        """The files written, relative to the run folder, in writing order."""

    @property
    def nbytes(self) -> int:
        """Tensor payload bytes."""


PlanT = TypeVar("PlanT", bound=NativePlanLike)


@dataclass(frozen=True)
class NativeExport(Generic[PlanT]):
    """The parts of one native export that its target decides.

    Attributes:
        plan: the plan for a tag (the decided one; for a URL, first the tag asked for).
        write: writes the plan's files of the checkpoint into the (empty) tag folder, with
            DeepSpeed's classes, reporting progress to the hooks; returns notes on what could
            not be kept.
        describe: what was written, for the summary (``DeepSpeed ZeRO-3 x8 ... checkpoint``).
        notes: notes on the destination, decided before anything is written.
    """

    plan: Callable[[str | None], PlanT]
    write: Callable[[UniversalCheckpoint, PlanT, DeepSpeedClasses, Path, ExportHooks], list[str]]
    describe: Callable[[PlanT], str]
    notes: Callable[[Destination], list[str]]


def run_native_export(
    ckpt: UniversalCheckpoint,
    out: str | Path,
    export: NativeExport[PlanT],
    *,
    world_size: int,
    stage: int,
    tag: str | None,
    overwrite: bool,
    remove_previous: bool,
    dry_run: bool,
    hooks: ExportHooks,
    clock: Stopwatch,
) -> ExportResult:
    """Export ``ckpt`` to ``out`` (a run folder or a URL) with ``export``'s plan and files.

    ``world_size`` and ``stage`` name a derived tag
    (:func:`~ucformat.export.run_folder.derived_tag`); the other options are those of
    :func:`ucformat.export.export_deepspeed`. ``clock`` started when the export did.

    Raises:
        StoreExistsError: see :func:`~ucformat.export.run_folder.plan_destination`.
        UnsupportedExportError: the plan refuses the target, or DeepSpeed is not importable.
    """
    if is_url(out):  # a fresh prefix: staged in a local folder, then uploaded
        tag_of_url = export.plan(tag).target.tag
        return export_to_url(
            str(out),
            lambda staged: run_native_export(
                ckpt,
                staged,
                export,
                world_size=world_size,
                stage=stage,
                tag=tag,
                overwrite=False,
                remove_previous=False,
                dry_run=dry_run,
                hooks=hooks,
                clock=Stopwatch(),
            ),
            owned=lambda name: name in (tag_of_url, LATEST_FILE),
            overwrite=overwrite,
            dry_run=dry_run,
            last=(LATEST_FILE,),
        )
    folder = Path(out)
    dest = plan_destination(
        folder,
        source_tag=ckpt.manifest.source.tag,
        tag=tag,
        world_size=world_size,
        stage=stage,
        overwrite=overwrite,
        remove_previous=remove_previous,
    )
    plan = export.plan(dest.tag)
    notes = export.notes(dest)
    if not dry_run:
        classes = deepspeed_classes("deepspeed")
        hooks.plan(plan.nbytes)
        tag_dir = prepare_folder(dest)
        notes = export.write(ckpt, plan, classes, tag_dir, hooks) + notes
        write_bytes(tag_dir.parent / LATEST_FILE, plan.target.tag.encode())
    verb = "would write" if dry_run else "wrote"
    summary = f"{verb} {export.describe(plan)} to {folder} in {clock.seconds:.2f}s"
    return ExportResult(
        "deepspeed", folder, list(plan.files), plan.nbytes, dry_run, clock.seconds, summary, notes
    )
