"""Checkpoint files on disk: written atomically, found again (``--ckpt_path last``), and checked before a resume.

Why not Lightning's own write: ``TorchCheckpointIO`` saves through an fsspec transaction whose temporary file is
made by ``tempfile.mkstemp()`` in the system temp folder, then moved into place. Where that folder is another
file system (a tmpfs, a container's overlay), the move is a copy, and a kill during the copy leaves a truncated
checkpoint under the real name; a killed write also leaves its temporary file in /tmp. ``atomic_torch_save``
writes next to the target (``.NAME.PID.partial``), flushes it to disk and renames it over the target, so a reader
sees the old file or the new one, whole, and never a mix. A sharded checkpoint (FSDP2: a folder every rank writes
its shards into) is written the same way as a folder beside its target and swapped in once complete
(``swap_in_staged``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import os
import re
import shutil
import types
import zipfile
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.core.mixins import HyperparametersMixin
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.runtime.models import loaded_dtype, resolve_dtype
from lit_grpo.runtime.validation import config_errors, huge_int, plain_values, plain_yaml_values, shown_value

PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.partial$")
#: A sharded checkpoint's folders beside ``NAME``: being written (``staging``), or the old one set aside while the
#: new one takes its place (``replaced``).
SWAP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(?P<kind>staging|replaced)$")

#: The settings a checkpoint must share with the run that resumes it: the model and its weights' layout, and the
#: objective (G and the loss). Anything else may change between a stop and a resume; other reward functions are
#: warned of (``check_resumable``). A nested setting (``loss``, a dataclass or a mapping) is compared field by field.
RESUME_SETTINGS = {
    "hyper_parameters": ("model", "dtype", "peft_config", "loss", "scale_rewards", "multi_objective_aggregation",
                         "sampler_correction", "mask_truncated_completions", "disable_dropout",
                         "cast_lm_head_to_fp32"),
    "datamodule_hyper_parameters": ("sampling.group_size",),
}
#: The file of a sharded checkpoint's folder that holds everything but the weights and optimizer states
#: (Lightning's ``ModelParallelStrategy`` writes it beside the shards).
SHARDED_HEADER = "meta.pt"
#: What a checkpoint must share with a run that only evaluates it (``lit-grpo validate``): the weights' layout.
WEIGHT_SETTINGS = {"hyper_parameters": ("model", "peft_config")}
#: Where a Lightning checkpoint holds the module's hyperparameters and the data module's.
HYPERPARAMETER_SECTIONS = ("hyper_parameters", "datamodule_hyper_parameters")


def partial_path(path: str | os.PathLike, pid: int | None = None) -> Path:
    """Where ``atomic_torch_save`` in process ``pid`` (default: this one) writes ``path`` before renaming it: a
    hidden file beside it, named by the process, so that no ``*.ckpt`` pattern matches it and two writers never
    share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}.partial")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that ``path`` is, at every moment, either its old content or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with open(partial, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    _sync_folder(path.parent)


def remove_stale_partials(folder: str | os.PathLike) -> list[Path]:
    """Delete the ``.partial`` files in ``folder`` left by writers that are no longer running (killed mid-write);
    returns what it removed."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = PARTIAL.match(entry.name)
        if match and not _running(int(match["pid"])):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed


def staging_path(path: str | os.PathLike, pid: int) -> Path:
    """Where the ranks of process ``pid``'s run (its rank 0's pid) write the sharded checkpoint ``path`` before
    ``swap_in_staged`` puts it in place: a hidden folder beside it that no ``*.ckpt`` pattern matches."""
    path = Path(path)
    return path.with_name(f".{path.name}.{pid}.staging")


def remove_staged(path: str | os.PathLike, pid: int) -> None:
    """Delete the staging folder of ``path`` left by an earlier save of process ``pid`` that did not finish."""
    _remove(staging_path(path, pid))


def swap_in_staged(path: str | os.PathLike, pid: int) -> None:
    """Put the complete staging folder of ``path`` (``staging_path``) in its place. The old ``path`` is set aside
    first and deleted last, so a kill leaves ``path`` whole, old or new, or (between the two renames) no ``path``
    but the old one aside and the new one staged, which ``finish_interrupted_swaps`` completes."""
    path = Path(path)
    staging, replaced = staging_path(path, pid), path.with_name(f".{path.name}.{pid}.replaced")
    _remove(replaced)
    if path.exists():
        os.replace(path, replaced)
    os.replace(staging, path)
    _remove(replaced)
    _sync_folder(path.parent)


def finish_interrupted_swaps(folder: str | os.PathLike, clean: bool = True) -> list[Path]:
    """Put right what killed sharded saves left in ``folder``; call it before this process saves there. A staged
    checkpoint whose swap a kill cut between its two renames (no ``NAME``, the old one set aside, the new one
    complete) takes its place, whoever wrote it. With ``clean`` the other leftovers (staged folders a kill cut
    short, old ones set aside) are deleted, unless another process that wrote them still runs here: one under this
    process's own pid is a reused pid's, as this process has saved nothing yet. Returns what it moved or deleted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    leftovers = [(entry, match) for entry in sorted(folder.iterdir()) if (match := SWAP.match(entry.name))]
    for target, staged in interrupted_swaps(folder):
        os.replace(staged, target)
        done.append(target)
    if not clean:
        return done
    for entry, match in leftovers:
        pid = int(match["pid"])
        if entry.exists() and (pid == os.getpid() or not _running(pid)):
            _remove(entry)
            done.append(entry)
    return done


def interrupted_swaps(folder: str | os.PathLike) -> list[tuple[Path, Path]]:
    """``(NAME, its staged folder)`` for each sharded save in ``folder`` that a kill cut between its two renames
    (no ``NAME``, the old one set aside, the new one complete): what ``finish_interrupted_swaps`` puts in place."""
    folder = Path(folder)
    swaps = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        match = SWAP.match(entry.name)
        if match and match["kind"] == "replaced":
            target = folder / match["name"]
            staged = staging_path(target, int(match["pid"]))
            if not target.exists() and staged.is_dir():
                swaps.append((target, staged))
    return swaps


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # the renames survive a power loss once the folder is synced
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local saves go through :func:`atomic_torch_save`; remote URLs
    (``s3://``, ...) keep Lightning's own write, which their stores make atomic."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


class PlainHyperparameters(HyperparametersMixin):
    """Hyperparameters saved as plain values. ``hparams`` hold each numpy scalar of what ``save_hyperparameters``
    stores (a setting computed with numpy or read through it, at any depth: np.float64, np.int64, np.str_, ...) as
    the Python value it holds (:func:`~lit_grpo.runtime.validation.plain_values`): torch.load(weights_only=True)
    refuses a checkpoint's hyperparameters with a numpy scalar. What a run writes of them is plain YAML besides
    (:func:`~lit_grpo.runtime.validation.plain_yaml_values`: each tuple a list, a path its text, a function its
    importable name or a marker that says none imports it), which ``yaml.safe_load`` reads: ``hparams_initial``,
    which Lightning's loggers write (hparams.yaml, TensorBoard's hparams), and a checkpoint's
    (:func:`plain_saved_hyperparameters`, called by the module's ``on_save_checkpoint``); ``hparams`` keep the
    tuples, paths and functions given, as the run reads them. One rule for every setting, so that none needs its own
    conversion before it is saved. Through Lightning's public names only (the method and the property it documents),
    so that an upgrade does not change it unseen. Listed before the Lightning class (``class M(PlainHyperparameters,
    LightningModule)``)."""

    def save_hyperparameters(self, *args: Any, frame: types.FrameType | None = None, **kwargs: Any) -> None:
        """Lightning's ``save_hyperparameters``, its values then made plain in place (Lightning's initial copy, taken
        before, is made plain as ``hparams_initial`` reads it)."""
        if frame is None:  # Lightning reads the init arguments from its caller's frame: here the one calling this
            frame = inspect.currentframe().f_back
        super().save_hyperparameters(*args, frame=frame, **kwargs)
        plain = plain_values(dict(self.hparams))
        self.hparams.clear()
        self.hparams.update(plain)
        #: What ``set_hparam`` sets after the initial copy is taken, which ``hparams_initial`` adds to it.
        self._hparams_set_later: dict[str, Any] = {}

    @property
    def hparams_initial(self) -> AttributeDict:
        """Lightning's initial copy of the hyperparameters with those ``set_hparam`` set later, as plain YAML: what
        Lightning's loggers write (hparams.yaml, TensorBoard's hparams plugin), which ``yaml.safe_load`` reads."""
        later = copy.deepcopy(getattr(self, "_hparams_set_later", {}))
        return AttributeDict(plain_yaml_values({**super().hparams_initial, **later}))

    def set_hparam(self, name: str, value: Any) -> None:
        """Set ``hparams[name]`` after ``save_hyperparameters`` (a setting saved in another form than it was given:
        a tool by its name, a dataset by its path), converted by the same rule, and in ``hparams_initial``, which is
        what Lightning's loggers write; ``hparams[name] = value`` would keep a numpy value as it is and reach only
        ``hparams``. Refused before ``save_hyperparameters``, which would drop it."""
        if not hasattr(self, "_hparams_set_later"):
            raise RuntimeError(f"set_hparam({shown_value(name)}, {shown_value(value, 80)}) before "
                               "save_hyperparameters: save_hyperparameters would drop it; set it after")
        self.hparams[name] = plain_values(value)
        self._hparams_set_later[name] = copy.deepcopy(self.hparams[name])


def plain_saved_hyperparameters(checkpoint: dict[str, Any]) -> None:
    """Make the module's and the data module's hyperparameters in ``checkpoint`` (Lightning's, before it is written)
    plain YAML (:func:`~lit_grpo.runtime.validation.plain_yaml_values`: each tuple a list, a path its text, a
    function its name), as hparams.yaml holds them, which torch.load(weights_only=True), Lightning's resume, reads;
    the module's ``on_save_checkpoint`` calls it, the one hook that sees both. A resume compares them with the run's
    own as plain YAML too (``check_resumable``), so a checkpoint that holds tuples resumes as before, and a function
    given again is the name it was saved as."""
    for section in HYPERPARAMETER_SECTIONS:
        if isinstance(checkpoint.get(section), Mapping):
            checkpoint[section] = plain_yaml_values(checkpoint[section])


def find_last_checkpoint(folders: Iterable[str | os.PathLike]) -> Path | None:
    """The newest ``last.ckpt`` (or ``last-vN.ckpt``) in ``folders``, by modification time; partial writes are
    never candidates. A sharded save cut between its renames counts as the checkpoint it completes (its staged
    folder, by that folder's time, which the rename keeps), so that a process finds the same one before and after
    rank 0 finishes the swap (``finish_interrupted_swaps``), whichever it sees."""
    times = {}
    for folder in folders:
        # the swaps first: one finished between the two listings is then in the second, as its NAME
        swaps = interrupted_swaps(folder)
        entries = [(path, path) for path in Path(folder).iterdir()] if Path(folder).is_dir() else []
        for path, holder in [*swaps, *entries]:
            if re.fullmatch(r"last(-v\d+)?\.ckpt", path.name):
                with contextlib.suppress(FileNotFoundError):  # renamed or replaced while listed
                    if holder.is_file() or holder.is_dir():
                        times[path] = holder.stat().st_mtime
    return max(times, key=times.__getitem__, default=None)


@dataclasses.dataclass(frozen=True)
class CheckpointIdentity:
    """What tells one checkpoint from another on every node, wherever each mounts the file system it is on:
    ``name``, its path under the folder ``--ckpt_path last`` searched (``version_0/checkpoints/last.ckpt``);
    ``global_step``, the trainer's step it holds (None where it has none); ``fingerprint``,
    :func:`checkpoint_fingerprint` of its content."""

    name: str
    global_step: int | None
    fingerprint: str


def checkpoint_identity(path: str | os.PathLike, root: str | os.PathLike | None = None) -> CheckpointIdentity:
    """The :class:`CheckpointIdentity` of the checkpoint at ``path``, named relative to ``root`` (its file name where
    it is not under ``root``); a file that cannot be read as a checkpoint has global step None."""
    path = Path(path)
    try:
        name = path.relative_to(root).as_posix() if root is not None else path.name
    except ValueError:
        name = path.name
    try:
        step = read_checkpoint_header(path).get("global_step")
    except (OSError, ValueError):
        step = None
    return CheckpointIdentity(name, step if isinstance(step, int) else None, checkpoint_fingerprint(path))


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """16 hex digits hashing the content of the checkpoint at ``path`` as its own index lists it, so that the file
    seen through another mount, or a copy of it, gives the same: each record of a torch (zip) file by its name within
    the archive, size and CRC-32 (``torch.save`` writes them; no data is read), any other file by its size. A sharded
    checkpoint's folder: each of its files so, by its name within the folder. A missing file hashes as nothing."""
    path = Path(path)
    files = sorted(entry for entry in path.rglob("*") if entry.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path).as_posix() if path.is_dir() else ''}\0".encode())
        try:
            with zipfile.ZipFile(file) as archive:  # records are ARCHIVE/NAME, ARCHIVE named after the file
                records = [(info.filename.split("/", 1)[-1], info.file_size, info.CRC) for info in archive.infolist()]
        except (zipfile.BadZipFile, OSError):
            records = [("", file.stat().st_size if file.is_file() else -1, 0)]
        digest.update(repr(records).encode())
    return digest.hexdigest()[:16]


def run_checkpoint_folders(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders of every run under a logger's root (``ROOT/VERSION/checkpoints``: ``version_N`` or a
    version the logger was given by name), the trainer's own (``ROOT/checkpoints``, used when there is no logger)
    and, under a trainer's root, its loggers' (``ROOT/NAME/VERSION/checkpoints``: a run resumed without the logger
    it was started with)."""
    root = Path(root)
    found = [folder for pattern in ("*/checkpoints", "*/*/checkpoints") for folder in root.glob(pattern)]
    return [*sorted(folder for folder in found if folder.is_dir()), root / "checkpoints"]


def read_checkpoint_header(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` with its tensors memory-mapped (nothing large is read), or a ``ValueError`` that
    names the file and says what is wrong with it: missing, cut short, or not a torch checkpoint. A sharded
    checkpoint's folder gives its header (``SHARDED_HEADER``): everything but the weights and optimizer states.
    ``weights_only`` is ``torch.load``'s (None: torch's default, True, as Lightning's resume reads the file): a file
    that would run code as it is unpickled is refused here, that code not run."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():  # a sharded checkpoint (FSDP2): its shards are checked by their own loader, its header here
        if not (path / SHARDED_HEADER).is_file():
            raise ValueError(f"checkpoint folder {path} has no {SHARDED_HEADER}: it is not a sharded Lightning "
                             "checkpoint, or its save did not finish; use another checkpoint")
        return read_checkpoint_header(path / SHARDED_HEADER, weights_only)
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {path} is empty (0 bytes): its write did not finish")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        raise ValueError(f"checkpoint {path} is cut short or is not a torch checkpoint (no zip directory at its end, "
                         f"{path.stat().st_size} bytes): its write was interrupted, or it is another kind of file; "
                         "use an earlier checkpoint (--ckpt_path last finds the newest whole one)") from None
    if not any(name.endswith("/data.pkl") for name in names):
        raise ValueError(f"checkpoint {path} is a zip archive but not a torch checkpoint (it has no data.pkl)")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as error:  # noqa: BLE001 - any reading failure is a bad file, named
        raise ValueError(f"checkpoint {path} cannot be read: {type(error).__name__}: {error}") from None
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    return dict(checkpoint)


class SettingsDiffer(ValueError):
    """A checkpoint trained with other settings than the run that would resume or evaluate it."""


def newest_run_hint(root: str | os.PathLike) -> str:
    """What a refusal of ``--ckpt_path last``'s checkpoint for other settings adds: it took the newest run under
    ``root`` (the logger's root), maybe another experiment's, and how to name the run meant."""
    return (f"--ckpt_path last takes the newest run under {root}, whatever its config: name the run you meant with "
            "--ckpt_path PATH, or give each experiment its own trainer.default_root_dir")


def check_resumable(path: str | os.PathLike, module_hparams: Mapping[str, Any],
                    datamodule_hparams: Mapping[str, Any] | None, evaluate: bool = False,
                    defaults: Mapping[str, Mapping[str, Any]] | None = None,
                    unread: Callable[[str, Mapping[str, Any]], Collection[str]] | None = None,
                    reward_changes: Callable[[Any, Any], list[str]] | None = None) -> None:
    """Raise, naming ``path`` and what is wrong, unless it is a lit_grpo training checkpoint that a run with these
    hyperparameters can resume: readable, from a ``GRPOModule`` fit, and with the same ``RESUME_SETTINGS``. With
    ``evaluate`` (a run that only evaluates it) its weights and ``WEIGHT_SETTINGS`` are all that must fit.

    ``defaults`` holds this release's default settings, as ``{"model": ..., "data": ...}``: a setting the checkpoint
    lacks (it was saved by a release that did not have it) reads as its default, so adding a setting to a later
    release does not refuse every older checkpoint; not where the checkpoint holds a setting this run does not have
    (renamed or moved, it may be the one missing). Without ``defaults`` a missing setting is compared as None.

    ``unread(name, group)`` names the fields of the group of settings ``name`` (``loss``) that a run with those
    values never reads: a field unread by the checkpoint's run and by this one is not compared, so a resume that
    drops a setting its run was warned was ignored is not refused.

    ``reward_changes(saved, now)`` (``lit_grpo.rollout.rewards.reward_changes``) names how this run's
    ``reward_funcs`` differ from the checkpoint's, one line each: a resume that changes them (on purpose, often) is
    not refused, but its reward curve, forecast and early stop then mix two objectives, so the lines are warned, once,
    where the checkpoint resumes (not where it is only evaluated, nor saved without its data module's settings)."""
    check_checkpoint_settings(read_checkpoint_header(path), path, module_hparams, datamodule_hparams, evaluate,
                              defaults, unread, reward_changes)


def check_checkpoint_settings(checkpoint: Mapping[str, Any], path: str | os.PathLike | None,
                              module_hparams: Mapping[str, Any], datamodule_hparams: Mapping[str, Any] | None,
                              evaluate: bool = False, defaults: Mapping[str, Mapping[str, Any]] | None = None,
                              unread: Callable[[str, Mapping[str, Any]], Collection[str]] | None = None,
                              reward_changes: Callable[[Any, Any], list[str]] | None = None) -> None:
    """:func:`check_resumable` of a checkpoint already read (``checkpoint``, the file at ``path``): the CLI's check
    of a file before anything loads it and the module's of what Lightning has loaded (``check_loaded_settings``)
    are this one, so both refuse with the same text."""
    needed = ("state_dict", "hyper_parameters") if evaluate else (
        "state_dict", "loops", "optimizer_states", "hyper_parameters")
    if path is not None and Path(path).is_dir():  # the weights and optimizer states are the shards beside the header
        needed = tuple(key for key in needed if key not in ("state_dict", "optimizer_states"))
    missing = [key for key in needed if key not in checkpoint]
    if missing:
        raise ValueError(f"checkpoint {path} is not a lit_grpo training checkpoint: it has no {', '.join(missing)} "
                         "(a weights-only file, or another program's)")
    current = {"hyper_parameters": module_hparams, "datamodule_hyper_parameters": datamodule_hparams or {}}
    differing = []
    for section, names in (WEIGHT_SETTINGS if evaluate else RESUME_SETTINGS).items():
        saved = checkpoint.get(section) or {}
        if section == "datamodule_hyper_parameters" and not saved:
            continue  # saved without a datamodule: nothing to compare
        prefix = "model." if section == "hyper_parameters" else "data."
        section_defaults = (defaults or {}).get(prefix[:-1]) or {}
        # A setting the checkpoint holds that this release does not have may be one it renamed or moved (flat loss
        # settings into model.loss): then a setting the checkpoint lacks ran as that one, not as its default.
        settings = _fields(current[section])
        unknown = [prefix + _key_text(key) for key in saved
                   if not (isinstance(key, str) and key.startswith("_")) and key not in settings]
        lacked = False
        for name in names:
            old, new = _fields(_lookup(saved, name, _MISSING)), _fields(_lookup(current[section], name))
            if name == "peft_config" and section == "hyper_parameters":
                if _is_empty_peft_config(new):  # GRPOModule refuses it, naming it: not another run's setting
                    continue
                old = None if _is_empty_peft_config(old) else old  # it trained all weights, as null does
            if old is not _MISSING and isinstance(old, dict) != isinstance(new, dict):
                old, new = {"": old}, {"": new}  # a group on one side only: compared whole
            old, new = _as_group(old), _as_group(new)
            # a setting this checkpoint's release did not have ran as its default
            default = {} if unknown else _as_group(_fields(_lookup(section_defaults, name, _MISSING)))
            skipped = set()
            if unread is not None and "" not in old and "" not in new:  # fields that neither run reads
                skipped = set(unread(name, {**default, **old})) & set(unread(name, {**default, **new}))
            for key in sorted(set(old) | set(new), key=_key_text):
                if key in skipped:
                    continue
                was, now = old.get(key, default.get(key)), new.get(key)
                compared = (was, now)
                if name == "dtype" and section == "hyper_parameters":  # null: the dtype its model loads in
                    compared = _null_dtype_as_loaded((was, _lookup(saved, "model")),
                                                     (now, _lookup(current[section], "model")))
                if _normalized(compared[0], name) != _normalized(compared[1], name):
                    shown = f"{prefix}{name}.{_key_text(key)}" if key != "" else f"{prefix}{name}"
                    differing.append(f"{shown}: {_shown(was, compared[0])} in the checkpoint, "
                                     f"{_shown(now, compared[1])} now")
                    lacked = lacked or key not in old
        if lacked and unknown:
            differing.append(f"(the checkpoint also holds {', '.join(unknown)}, which this release does not have: "
                             "what it lacks may be one of them renamed, so it is not read as its default)")
    if differing and evaluate:
        raise SettingsDiffer(f"checkpoint {path} holds the weights of another model than this run's:\n  "
                         + "\n  ".join(differing) + "\nUse the checkpoint's model settings.")
    if differing:
        raise SettingsDiffer(f"checkpoint {path} was trained with other settings than this run's; a resume would not "
                         "continue the same run:\n  " + "\n  ".join(differing)
                         + "\nUse the checkpoint's settings, or start a new run without --ckpt_path.")
    saved_data = checkpoint.get("datamodule_hyper_parameters")
    now = _MISSING if datamodule_hparams is None else _lookup(datamodule_hparams, "reward_funcs", _MISSING)
    if (not evaluate and reward_changes is not None and isinstance(saved_data, Mapping)
            and "reward_funcs" in saved_data and now is not _MISSING):
        changes = reward_changes(saved_data["reward_funcs"], _fields(now))
        if changes:
            rank_zero_warn(f"checkpoint {path} was trained with other reward functions than this run's:\n  "
                           + "\n  ".join(changes) + "\nIt resumes, but the reward logged from here on measures "
                           "another objective: its curve, forecast and early stop mix the two. To keep them apart, "
                           "start a new run from its weights (lit-grpo export, then model.model: the export).")


def init_defaults(cls: type) -> dict[str, Any]:
    """The default of each ``__init__`` argument of ``cls`` and of its bases (a subclass's own where both have one):
    this release's settings, which a setting an older release's checkpoint lacks reads as (``check_resumable``'s
    ``defaults``, in a script, where no parser holds them)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters
        except (TypeError, ValueError):  # a builtin's, without a signature: no defaults of settings
            continue
        defaults.update({name: p.default for name, p in parameters.items() if p.default is not p.empty})
    return defaults


#: The attribute by which ``mark_settings_checked`` tells ``check_loaded_settings`` that a checkpoint was compared:
#: its path and whether for a run that only evaluates it.
_CHECKED = "_lit_grpo_checked_ckpt_path"


def mark_settings_checked(module: Any, path: str | os.PathLike, *, evaluate: bool) -> None:
    """Note on ``module`` that the checkpoint at ``path`` was compared with its run's settings already, for a fit
    (every resume setting) or, with ``evaluate``, for a run that only evaluates it (the weights' settings): the
    module's ``check_loaded_settings`` then does not compare it again as Lightning loads it for that kind of run, nor
    warn of its reward functions a second time. ``lit-grpo`` compares it before anything loads (with its parser's
    defaults, and every rank's refusal compared); under FSDP2 ``GRPOModule`` compares it before the strategy loads
    it. A mark stands for the one load it was made for: the comparison it skips takes it off."""
    setattr(module, _CHECKED, (_path_key(path), bool(evaluate)))


def forget_settings_checked(module: Any) -> None:
    """Take off ``module`` the mark of :func:`mark_settings_checked`, if any: the load it was made for failed, so
    the next load of that file (the same module fitted again) is compared."""
    if hasattr(module, _CHECKED):
        delattr(module, _CHECKED)


def _path_key(path: str | os.PathLike) -> str:
    """``path`` as ``mark_settings_checked`` compares it: a local file by its real path (Lightning is handed the text
    the CLI checked, but a script may spell it otherwise), a URL as given."""
    text = os.fspath(path)
    return text if "://" in text else os.path.realpath(text)


def check_loaded_settings(checkpoint: Mapping[str, Any], module: Any, trainer: Any,
                          unread: Callable[[str, Mapping[str, Any]], Collection[str]] | None = None,
                          reward_changes: Callable[[Any, Any], list[str]] | None = None) -> None:
    """``lit-grpo fit --ckpt_path``'s check (:func:`check_resumable`) of the checkpoint Lightning loads into
    ``module`` in ``trainer`` (``GRPOModule.on_load_checkpoint`` calls it first, before any of it is taken), so
    that a script's ``trainer.fit(model, datamodule=dm, ckpt_path=PATH)`` is refused as the command is: a
    ``ConfigError`` of ``--ckpt_path`` caused by the ``SettingsDiffer`` that names each setting that differs, other
    reward functions warned of once; a validate or test (not a fit) compares the weights' settings only. A setting
    an older release's checkpoint lacks reads as this release's default, the module's and the data module's
    ``__init__`` defaults (:func:`init_defaults`). The data settings are compared where the trainer's data module
    has them (``RolloutDataModule``'s), not with another data module's, whose settings are others. Nothing is
    compared without a trainer (``load_from_checkpoint``: the settings are the checkpoint's own) nor for a
    checkpoint compared already for this kind of run (:func:`mark_settings_checked`). ``unread`` and
    ``reward_changes`` are :func:`check_resumable`'s, the command's
    (``lit_grpo.update.resume_settings.unread_settings``, ``lit_grpo.rollout.rewards.reward_changes``)."""
    if trainer is None:
        return
    path, evaluate = getattr(trainer, "ckpt_path", None), _evaluates(trainer)
    if _marked(module, path, evaluate):
        delattr(module, _CHECKED)  # the load it was made for: another load of the same file is compared
        return
    if "state_dict" not in checkpoint and _loads_weights_itself(getattr(trainer, "strategy", None)):
        # FSDP2's strategy took the weights from a whole file before this hook, as it takes a folder's shards
        checkpoint = {**checkpoint, "state_dict": {}}
    datamodule = getattr(trainer, "datamodule", None)
    data_hparams = getattr(datamodule, "hparams", None)
    data_names = RESUME_SETTINGS["datamodule_hyper_parameters"]
    if data_hparams is None or any(_lookup(data_hparams, name, _MISSING) is _MISSING for name in data_names):
        checkpoint = {key: value for key, value in checkpoint.items() if key != "datamodule_hyper_parameters"}
        data_hparams = None
    defaults = {"model": init_defaults(type(module)),
                "data": init_defaults(type(datamodule)) if datamodule is not None else {}}
    with config_errors("--ckpt_path"):
        check_checkpoint_settings(checkpoint, path, module.hparams, data_hparams, evaluate=evaluate,
                                  defaults=defaults, unread=unread, reward_changes=reward_changes)


def check_settings_before_load(path: str | os.PathLike, module: Any, trainer: Any,
                               unread: Callable[[str, Mapping[str, Any]], Collection[str]] | None = None,
                               reward_changes: Callable[[Any, Any], list[str]] | None = None,
                               weights_only: bool | None = None) -> None:
    """:func:`check_loaded_settings` of the checkpoint at ``path`` (``trainer.ckpt_path``) before a strategy that
    loads its weights and optimizer states itself takes them (FSDP2's ``ModelParallelStrategy``, before the module's
    ``on_load_checkpoint`` runs): its header (:func:`read_checkpoint_header`: a folder's ``SHARDED_HEADER``, a whole
    file memory-mapped) compared, a refusal raised before anything loads, then the checkpoint marked compared for
    this kind of run (:func:`mark_settings_checked`) so that ``on_load_checkpoint`` neither compares it again nor
    warns of its reward functions twice. A URL is not read here: it is compared as ``on_load_checkpoint`` gets it.
    ``weights_only`` is the load's (None: torch's default): a file is unpickled here only as that load would. Another
    strategy that restores after setup (DeepSpeed's folder has no header here) is compared in ``on_load_checkpoint``.
    """
    evaluate = _evaluates(trainer)
    if ("://" in os.fspath(path) or not _loads_weights_itself(getattr(trainer, "strategy", None))
            or _marked(module, path, evaluate)):  # compared already (lit-grpo): its mark left to on_load_checkpoint
        return
    with config_errors("--ckpt_path"):  # missing, cut short or not a checkpoint: named as lit-grpo names it
        header = read_checkpoint_header(path, weights_only)
    check_loaded_settings(header, module, trainer, unread=unread, reward_changes=reward_changes)
    mark_settings_checked(module, path, evaluate=evaluate)


def _evaluates(trainer: Any) -> bool:
    """Whether ``trainer`` loads a checkpoint for a run that only evaluates it (not a fit)."""
    return getattr(getattr(trainer, "state", None), "fn", "fit") != "fit"


def _marked(module: Any, path: str | os.PathLike | None, evaluate: bool) -> bool:
    """Whether ``module`` holds the mark of :func:`mark_settings_checked` for ``path`` and this kind of run."""
    return path is not None and getattr(module, _CHECKED, None) == (_path_key(path), evaluate)


def _loads_weights_itself(strategy: Any) -> bool:
    """Whether ``strategy`` loads a checkpoint's weights in its ``load_checkpoint`` and hands the module's
    ``on_load_checkpoint`` the rest (FSDP2's ``ModelParallelStrategy``, a whole file's too)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def check_sharded_param_groups(path: str | os.PathLike, built: int, weight_decay: float) -> None:
    """Raise, naming both counts, where the sharded checkpoint at ``path`` (FSDP2's folder) holds an optimizer of
    other than ``built`` param groups, those of this run's optimizer (``weight_decay_groups`` at ``weight_decay``):
    FSDP2 loads a sharded optimizer into the groups as built, before a hook could regroup it, and fails on the
    missing keys or in the schedule's load. Checked as the fit loads it (``GRPOModule``), where the groups exist."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (Path(path) / ".metadata").is_file():  # no index of the shards: left to their loader, which names it
        return
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = len({found[1] for key in keys if (found := re.search(r"\.param_groups\.(\d+)\.", key))})
    if saved and saved != built:
        raise ValueError(f"checkpoint {path}: its optimizer has {saved} param group(s), this run's {built} "
                         f"(model.weight_decay {weight_decay}; weight_decay_groups: one group at 0 or under LoRA, "
                         "above 0 a second of the biases and normalization weights); FSDP2 loads a sharded optimizer "
                         "into the groups as built, so they must agree: resume it with the settings it was saved "
                         "with (one group: model.weight_decay 0 or a model.peft_config; two: model.weight_decay > 0 "
                         "without one), or start a new run without --ckpt_path")


def check_weight_shapes(path: str | os.PathLike | None, saved: Mapping[str, Any],
                        model: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` naming the checkpoint at ``path``, its first weight (in ``saved``' order) whose shape
    differs from the model's of that name and both shapes, where any does: the checkpoint holds another model's
    weights (a model folder changed since it was saved, an edited file). ``saved``, ``model``: state dicts (names to
    tensors, or anything with a ``shape``); a name only one of them has is not compared (strict loading names it)."""
    differing = [(name, tuple(value.shape), tuple(model[name].shape)) for name, value in saved.items()
                 if name in model and hasattr(value, "shape") and tuple(value.shape) != tuple(model[name].shape)]
    if differing:
        name, there, here = differing[0]
        others = f" ({len(differing) - 1} more weights differ too)" if len(differing) > 1 else ""
        where = f"checkpoint {path}" if path else "the checkpoint"
        raise ValueError(f"{where} holds weights of other shapes than this run's model: "
                         f"{name} is {list(there)} there, {list(here)} in the model{others}. It was saved from "
                         "another model: use that model's settings, or a checkpoint of this model")


def exception_save_hazard(callbacks: Iterable[Any], world_size: int) -> str | None:
    """A warning where a run of ``world_size`` processes has a Lightning ``ModelCheckpoint`` that saves on an error
    (``save_on_exception=True``), else None. That save runs in the failing rank's ``on_exception`` and its
    collectives (a barrier, a broadcast) pair with what the other ranks, still training, run next: the run hangs or
    fails elsewhere instead of ending on the error. Lightning allows it, and an error raised on every rank together
    saves, so it is said, not refused."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saving = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint) and getattr(cb, "save_on_exception", False)]
    if world_size <= 1 or not saving:
        return None
    return (f"{type(saving[0]).__name__}(save_on_exception=True) under {world_size} processes: an error on one rank "
            "saves there alone, and that save's collectives (a barrier, a broadcast) meet the other ranks' training "
            "collectives, so the run can hang until the process group's timeout instead of ending on the error. "
            "Set save_on_exception=False; lit_grpo's RunCheckpoint keeps last.ckpt current and saves a stop that "
            "every rank agrees on")


#: ``_lookup``'s answer for a setting that is not there, where None is a value.
_MISSING = object()


def _lookup(mapping: Mapping[str, Any], dotted: str, missing: Any = None) -> Any:
    value: Any = mapping
    for part in dotted.split("."):
        if isinstance(value, Mapping):
            value = value.get(part, missing)
        else:
            value = getattr(value, part, missing)
        if value is missing:
            return missing
    return value


def _as_group(value: Any) -> dict:
    """A setting as a dict of its fields: a group's own, ``{"": value}`` for a single value, none if missing."""
    if value is _MISSING:
        return {}
    return value if isinstance(value, dict) else {"": value}


def _fields(value: Any) -> Any:
    """A settings dataclass or a namespace (the CLI's config before it builds one) as a dict of its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "as_dict"):  # jsonargparse's Namespace
        return value.as_dict()
    return value


def _is_empty_peft_config(value: Any) -> bool:
    """Whether ``value`` is an empty ``peft_config``, which older releases took and ``GRPOModule`` refuses now: a
    checkpoint's trained all weights, as null does, so null resumes it; a run's own is left to that refusal, which
    names it, whatever the checkpoint holds (compared as null it was said to be None against a LoRA checkpoint)."""
    return isinstance(value, dict) and not value


def _null_dtype_as_loaded(saved: tuple[Any, Any], current: tuple[Any, Any]) -> tuple[Any, Any]:
    """The checkpoint's and this run's ``dtype``, each given as ``(dtype, model)``: where one is null (the model's
    own) and the other is not, the null one as the dtype its model loads in (``loaded_dtype``), so that null and
    ``float32`` are one setting for a float32 model; left null where that cannot be told without loading it."""
    (was, saved_model), (now, current_model) = saved, current
    if (was is None) == (now is None):
        return was, now
    model = saved_model if was is None else current_model
    dtype = None
    with contextlib.suppress(ValueError):  # no model's name or path (a corrupt checkpoint's): not told
        dtype = loaded_dtype(model)
    if dtype is None:
        return was, now
    return (dtype, now) if was is None else (was, dtype)


def _shown(value: Any, compared: Any) -> str:
    """A setting's value as a difference names it (:func:`shown_value`; whole, as two paths may differ at their
    ends); a null dtype with the dtype it was compared as."""
    if value is None and isinstance(compared, torch.dtype):
        return f"None (its model's own dtype, {str(compared).removeprefix('torch.')})"
    return shown_value(value, 1000)


def _key_text(key: Any) -> str:
    """A settings key as a difference names it after its group's (``model.KEY``): a string itself, another key
    (a hand-edited checkpoint's) as :func:`shown_value` shows it, in parentheses where that is words (an int too long
    to print), as :func:`shown_setting` shows a value."""
    if isinstance(key, str):
        return key
    huge = huge_int(key)
    return f"({huge})" if huge is not None else shown_value(key)


def _normalized(value: Any, name: str = "") -> Any:
    if name == "dtype" and isinstance(value, str):  # "bf16" and "bfloat16" are one dtype
        with contextlib.suppress(ValueError, KeyError):
            return resolve_dtype(value)
    # a tuple and the list of its values are one setting, at any depth: a Python run's settings hold tuples where
    # the command line's hold lists, and a checkpoint saved before hyperparameters were plain YAML holds them too
    return plain_yaml_values(value)


def check_writable(folder: str | os.PathLike, needed_bytes: int = 0, what: str = "checkpoint folder",
                   fix: str = "set trainer.default_root_dir, or the checkpoint callback's dirpath, to a writable "
                              "folder") -> None:
    """Raise unless a checkpoint of ``needed_bytes`` can be written in ``folder`` (created if missing): a probe
    file is written and removed, and the free space is compared with what one more file needs. ``what`` names the
    folder in the message and ``fix`` says what to do (defaults: a checkpoint folder's)."""
    folder = Path(folder)
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as error:
        raise PermissionError(f"{what} {folder} cannot be written ({error.strerror or error}): {fix}") from None
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize if hasattr(os, "statvfs") else None
    if free is not None and needed_bytes > free:
        raise OSError(f"checkpoint folder {folder} has {free / 2**30:.2f} GiB free, and one checkpoint of this run "
                      f"needs about {needed_bytes / 2**30:.2f} GiB (weights and optimizer state): free some space or "
                      "point trainer.default_root_dir elsewhere")
