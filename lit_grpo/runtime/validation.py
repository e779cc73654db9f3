"""Argument checks shared across lit_grpo: each error names the bad value and what is allowed."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

#: The largest seed: numpy's and Lightning's (``seed_everything``) bound, so one seed means the same everywhere.
SEED_MAX = 2**32 - 1


#: ``torch_num_threads``' bound, in threads per core: more only wait on each other (and thousands crash OpenMP).
MAX_THREADS_PER_CORE = 4


_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_SELF_CGROUP = "/proc/self/cgroup"
_PROC_SELF_MOUNTINFO = "/proc/self/mountinfo"


class CoreLimit(NamedTuple):
    """The cores this process may use, and the CPUs its cgroup's CPU quota grants where they are fewer than the CPU
    affinity's cores (1.5 for a limit of 1.5 CPUs, taken as 2 cores; None where the quota grants no fewer)."""

    cores: int
    quota_cpus: float | None = None


def quota_cpus(quotas: Iterable[str]) -> float | None:
    """The CPUs the tightest of ``quotas`` grants, each a cgroup's CPU quota as cgroup v2's ``cpu.max`` writes it
    (``"QUOTA PERIOD"`` in microseconds; a QUOTA of ``max``, or v1's ``-1``, sets none): QUOTA / PERIOD; None where
    none sets a quota."""
    granted = []
    for text in quotas:
        try:
            quota, period = (int(field) for field in text.split()[:2])
        except ValueError:  # "max", or a text the kernel would not write: no quota to go by
            continue
        if quota > 0 and period > 0:
            granted.append(quota / period)
    return min(granted, default=None)


class CgroupMount(NamedTuple):
    """A cgroup hierarchy mounted at ``mount_point``, showing there its cgroup ``root`` and those below it: cgroup
    v1's, with the ``controllers`` it holds, or v2's (``controllers`` None)."""

    root: str
    mount_point: str
    controllers: frozenset[str] | None


_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


def cgroup_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup hierarchies' mounts that a ``/proc/self/mountinfo`` text lists, one a line: ``ID PARENT
    MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL FIELDS] - FSTYPE SOURCE SUPER_OPTIONS``, of FSTYPE ``cgroup``
    (v1, whose SUPER_OPTIONS name its controllers: ``rw,cpu,cpuacct``) or ``cgroup2``; paths as the kernel escapes
    them (a space as ``\\040``). Of two mounts at one mount point the later, which hides the earlier, counts."""
    mounts = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            fstype = fields[fields.index("-", 6) + 1]
        except (ValueError, IndexError):  # not a mount's line
            continue
        if fstype in ("cgroup", "cgroup2"):
            root, mount_point = (_MOUNTINFO_ESCAPE.sub(lambda code: chr(int(code.group(1), 8)), path)
                                 for path in fields[3:5])
            # SUPER_OPTIONS last: a SOURCE may be empty
            controllers = frozenset(fields[-1].split(",")) if fstype == "cgroup" else None
            mounts[mount_point] = CgroupMount(root, mount_point, controllers)
    return list(mounts.values())


def cgroup_cpu_quotas() -> list[str]:
    """The CPU quotas, as ``cpu.max`` texts, of this process's cgroups (:func:`cpu_quota_texts` of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``); ``[]`` where there are no cgroups."""
    try:
        with open(_PROC_SELF_CGROUP, "rb") as file:  # a cgroup's name is any bytes: decoded as the file system's
            memberships = os.fsdecode(file.read())
    except OSError:
        return []
    try:
        with open(_PROC_SELF_MOUNTINFO, "rb") as file:
            mountinfo = os.fsdecode(file.read())
    except OSError:
        mountinfo = ""
    return cpu_quota_texts(memberships, mountinfo, _read_text)


def cpu_quota_texts(proc_self_cgroup: str, mountinfo: str, read_text: Callable[[str], str]) -> list[str]:
    """The CPU quotas, as ``cpu.max`` texts, of the cgroups that ``proc_self_cgroup`` (``/proc/self/cgroup``'s text)
    names and of those above them that a mount shows (:func:`_cgroup_folders`): cgroup v2's ``cpu.max``, v1's
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (of the hierarchy that holds the ``cpu`` controller), each
    file's text as ``read_text`` gives it (stripped; ``""`` where there is none)."""
    mounts = cgroup_mounts(mountinfo)
    quotas = []
    for membership in proc_self_cgroup.splitlines():  # "ID:CONTROLLERS:PATH"; v2's CONTROLLERS are empty
        _, controllers, path = (membership.split(":", 2) + ["", ""])[:3]
        if (controllers and "cpu" not in controllers.split(",")) or ".." in path.split("/"):
            continue  # not the cpu controller's, or outside this cgroup namespace: no folder seen is it or above it
        for folder in _cgroup_folders(path, controllers, mounts):
            if controllers:
                quotas.append(f"{read_text(os.path.join(folder, 'cpu.cfs_quota_us'))} "
                              f"{read_text(os.path.join(folder, 'cpu.cfs_period_us'))}".strip())
            else:
                quotas.append(read_text(os.path.join(folder, "cpu.max")))
    return [quota for quota in quotas if quota]


def _cgroup_folders(path: str, controllers: str, mounts: Iterable[CgroupMount]) -> list[str]:
    """The folders of the cgroup ``path`` (as ``/proc/self/cgroup`` names it) of the hierarchy that holds the cpu
    controller among v1's ``controllers`` (``""``: v2's) and of the cgroups above it, from the highest seen: under
    the mount of that hierarchy whose root is ``path`` or above it (of several, the one that shows most), none
    where its mounts show other cgroups only (a container's mount root is its own cgroup, the paths outside it not
    seen); where ``mounts`` hold none of the hierarchy, under ``/sys/fs/cgroup`` (v1: its folder named as
    ``controllers``, ``cpu,cpuacct``). A container sees its own cgroup at the mount point, which
    ``/proc/self/cgroup`` may name by the host's path: the folders missing are passed over by the reader, so the
    mount point itself is read too."""
    parts = [part for part in path.split("/") if part]
    hierarchy = [mount for mount in mounts if (mount.controllers is None if not controllers
                                               else mount.controllers is not None and "cpu" in mount.controllers)]
    if not hierarchy:
        folders = [_CGROUP_ROOT if not controllers else os.path.join(_CGROUP_ROOT, controllers)]
    else:
        showing = []
        for mount in hierarchy:
            root = [part for part in mount.root.split("/") if part]
            if parts[:len(root)] == root:
                showing.append((len(root), mount.mount_point))
        if not showing:
            return []
        depth, mount_point = min(showing, key=lambda shown: shown[0])
        folders, parts = [mount_point], parts[depth:]
    for part in parts:
        folders.append(os.path.join(folders[-1], part))
    return folders


def _read_text(path: str) -> str:
    """The stripped text of the file at ``path``; ``""`` where there is none (a cgroup's or a folder's missing)."""
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def core_limit() -> CoreLimit:
    """The cores this process may use: its CPU affinity's (``os.cpu_count()`` where that is unknown), or fewer where
    its cgroup's CPU quota (a container's: Docker ``--cpus``, a Kubernetes CPU limit) grants fewer. The quota, not
    the affinity, is the CPU time the kernel gives: in a 4-CPU container the affinity shows every core of the host,
    and threads beyond the quota's 4 are stopped (throttled) until its next period, spinning OpenMP threads burning
    it meanwhile."""
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    else:
        affinity = os.cpu_count() or 1
    cpus = quota_cpus(cgroup_cpu_quotas())
    # a share of a core counts as one (as the JVM and loky count it): the quota's threads are throttled together,
    # not one waiting behind another at every op (docs/benchmarks.md, "Threads")
    if cpus is not None and cpus < affinity:
        return CoreLimit(min(math.ceil(cpus), affinity), quota_cpus=cpus)
    return CoreLimit(affinity)


def available_cores() -> int:
    """The cores this process may use (:func:`core_limit`): its CPU affinity, or its cgroup's CPU quota if less."""
    return core_limit().cores


def default_threads(local_processes: int = 1) -> int | None:
    """Torch's thread count for one of ``local_processes`` on this node where none is given: None where
    ``OMP_NUM_THREADS`` is set (torch took it when it started), else its share of the cores this process may use
    (torch's own default counts the host's cores, not a container's CPU quota)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return core_share(available_cores(), local_processes)


def core_share(cores: int, local_processes: int = 1) -> int:
    """The cores each of ``local_processes`` on a node may take of the ``cores`` they divide: at least one."""
    local_processes = check_int("local_processes", local_processes, 1)
    return max(1, cores // local_processes)


def check_thread_count(name: str, threads: int) -> int:
    """``threads`` as a plain int if it is an integer in [1, ``MAX_THREADS_PER_CORE`` x the cores this process may
    use], else a ValueError naming ``name``, the value and that range."""
    cores, cpus = core_limit()
    count = integer_within(threads, 1, MAX_THREADS_PER_CORE * cores)
    if count is None:
        of_the = (f"{cores} this process's cgroup CPU quota of {cpus:g} CPUs grants" if cpus is not None
                  else f"{cores} this process may run on")
        raise ValueError(f"{shown_setting(name, threads)} must be in [1, {MAX_THREADS_PER_CORE * cores}] "
                         f"({MAX_THREADS_PER_CORE} a core of the {of_the})")
    return count


class ConfigError(ValueError):
    """A bad setting found while a run sets itself up (a prompt source, a dtype, a dataset column): ``lit-grpo``
    reports it as it reports a parse error, one ``error:`` line and exit 2, wherever it is raised."""


@contextlib.contextmanager
def config_errors(where: str, settings: Collection[str] = ()) -> Iterator[None]:
    """Re-raise what a setting makes fail in this block (a ValueError, a missing file or key, a wrong type) as a
    :class:`ConfigError` whose message starts with ``where`` (see :func:`setting_message`; ``settings``: the names
    of the settings under ``where``)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError, KeyError, TypeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ConfigError(setting_message(where, str(message), settings)) from error


_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_LEADING_SETTING = re.compile(r"([A-Za-z_][\w.]*)=")


def setting_message(where: str, message: str, settings: Collection[str] = ()) -> str:
    """``message`` said under the config key ``where``. One that starts with a setting and its value names it by its
    key, as the command line writes it: a setting of ``settings`` (``data``, ``val_size=-1 ...``:
    ``data.val_size=-1 ...``), or ``where``'s own (``model.peft_config``, ``peft_config.r=0 ...``:
    ``model.peft_config.r=0 ...``). Any other message follows ``where: ``: a name not known to be a setting under
    ``where`` (a tool's check of ``over_provision``) is not given a key that does not exist."""
    leading = _LEADING_SETTING.match(message)
    if leading is None or not _DOTTED_KEY.fullmatch(where):
        return f"{where}: {message}"
    outer, name = where.split("."), leading.group(1).split(".")
    if name[0] == outer[-1]:
        key = ".".join(outer[:-1] + name)
    elif name[0] in settings:
        key = ".".join(outer + name)
    else:
        return f"{where}: {message}"
    return key + message[len(leading.group(1)):]


def huge_int(value: Any) -> str | None:
    """An int beyond float range said by its count of digits ("an int of 401 digits"), for an error message: Python
    refuses to print one of more than ``sys.get_int_max_str_digits()`` (4300 by default), and hundreds of digits
    say nothing; None for any other value."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        float(value)
        return None
    except OverflowError:
        pass
    size = abs(value)
    digits = math.floor(math.log10(size)) + 1
    # log10 rounds either way: 10**k - 1 up to k, some powers of ten (10**512) just below theirs
    digits += (size >= 10 ** digits) - (10 ** (digits - 1) > size)
    return f"{'a negative' if value < 0 else 'an'} int of {digits} digits"


def shown_value(value: Any, width: int = 100) -> str:
    """``value``'s repr cut to ``width`` characters, for an error message; an int beyond float range by its digits
    (``huge_int``), and a value holding an int too long to print as that."""
    huge = huge_int(value)
    return huge if huge is not None else _cut_repr(value, width)


def shown_setting(name: str, value: Any, width: int = 100) -> str:
    """``name=value`` as a refusal of a setting or a state's key starts, the value as :func:`shown_value` shows it
    (cut to ``width``), an int beyond float range in parentheses, where its words would run into the refusal's:
    ``n=(an int of 5001 digits) must be ...``."""
    huge = huge_int(value)
    return f"{name}=({huge})" if huge is not None else f"{name}={_cut_repr(value, width)}"


def _cut_repr(value: Any, width: int) -> str:
    """``value``'s repr cut to ``width`` characters; a value holding an int too long to print said by its type (its
    repr raises Python's int-to-str ValueError)."""
    try:
        return repr(value)[:width]
    except ValueError as err:  # a container's repr met such an int
        if "integer string conversion" not in str(err):
            raise
        kind = type(value).__name__
        return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} holding an int of more than " \
               f"{sys.get_int_max_str_digits()} digits"


def integer_within(value: Any, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """``value`` as a plain int if it is an integral number within the bounds, else None: an int or a numpy integer
    (a setting computed with numpy, or read through it), not a bool (nor numpy's, which is no ``numbers.Integral``).
    The rule of :func:`check_int`, for a check that words its refusal itself."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        return None
    return number


def check_int(name: str, value: Any, minimum: int, hint: str = "", none: bool | str = False) -> int | None:
    """``value`` as a plain int if it is an integral number (an int or a numpy integer, not a bool) ``>= minimum``
    (or None where ``none``: True, or a text saying what None means, said after it in parentheses), else a
    ValueError naming it (and ``hint``, said after it in parentheses). :func:`check_int_in_range` with no upper
    bound, said shorter."""
    if value is None and none:
        return None
    number = integer_within(value, minimum, None)
    if number is None:
        raise ValueError(f"{shown_setting(name, value)} must be an integer >= {minimum}"
                         + (f" ({hint})" if hint else "") + _or_none(none))
    return number


def _or_none(none: bool | str) -> str:
    """What a check's refusal adds where it takes None: " or None", and what None means where ``none`` says it."""
    if not none:
        return ""
    return " or None" + (f" ({none})" if isinstance(none, str) else "")


def check_int_in_range(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a plain int if it is an integral number (an int or a numpy integer, not a bool) within the
    bounds, else a ValueError naming it."""
    number = integer_within(value, minimum, maximum)
    if number is None:
        bounds = " and ".join(f"{sign} {bound}" for sign, bound in ((">=", minimum), ("<=", maximum))
                              if bound is not None)
        raise ValueError(f"{shown_setting(name, value)} is not allowed; {name} must be an integer"
                         + (f" {bounds}" if bounds else ""))
    return number


def check_real(name: str, value: Any, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, hint: str = "", none: bool | str = False,
               finite: bool = True) -> float | None:
    """``value`` as a float if it is a finite real (not a bool; an infinite one too unless ``finite``) within the
    bounds (``low`` excluded when ``low_open``, ``high`` when ``high_open``), or None where ``none`` (True, or a text
    saying what None means), else a ValueError naming it (and ``hint``, said after the bounds in parentheses: what a
    value means, as "0 disables it")."""
    if value is None and none:
        return None
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    allowed = ("a finite number" if finite else "a number") + (" " + " and ".join(bounds) if bounds else "")
    number = real_within(value, low, high, low_open, high_open, finite)
    if number is None:
        raise ValueError(f"{shown_setting(name, value)} is not allowed; {name} must be {allowed}"
                         + (f" ({hint})" if hint else "") + _or_none(none))
    return number


def real_within(value: Any, low: float | None = None, high: float | None = None, low_open: bool = False,
                high_open: bool = False, finite: bool = True) -> float | None:
    """``value`` as a plain float if it is a finite real number (or an infinite one, unless ``finite``; never NaN)
    within the bounds (``low`` excluded when ``low_open``, ``high`` when ``high_open``), else None: an int, a float
    or a numpy number (np.float32, np.int64: a setting computed with numpy), not a bool (nor numpy's). The rule of
    :func:`check_real`, for a check that words its refusal itself."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return None
    if math.isnan(number) or (finite and math.isinf(number)):
        return None
    if low is not None and (number <= low if low_open else number < low):
        return None
    if high is not None and (number >= high if high_open else number > high):
        return None
    return number


def check_field(config: Any, name: str, check: Callable[..., Any], *bounds: Any, prefix: str = "",
                **options: Any) -> Any:
    """Check the field ``name`` of ``config``, a frozen dataclass in its ``__post_init__``, with ``check``
    (:func:`check_int`, :func:`check_real`, ...: given the key ``prefix + name``, the field's value, ``bounds`` and
    ``options``) and keep what it returns in the field: a numpy number as the plain number it is, which the config's
    owner stores and a checkpoint's hyperparameters save. Returns it."""
    value = check(prefix + name, getattr(config, name), *bounds, **options)
    object.__setattr__(config, name, value)  # a frozen dataclass's own __post_init__ may set its fields
    return value


def plain_values(value: Any) -> Any:
    """``value`` with each numpy scalar in it (np.float64, np.int64, ...; in a mapping, list or tuple, at any depth)
    as the plain Python value it holds, a mapping as a dict: the settings a checkpoint's hyperparameters save
    (``runtime.checkpoints.PlainHyperparameters``), which torch.load(weights_only=True) reads back only without numpy
    scalars."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {plain_values(key): plain_values(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_values(item) for item in value)
    return value


def plain_yaml_values(value: Any) -> Any:
    """``value`` as plain YAML holds it: :func:`plain_values` with each list or tuple in it (at any depth) a list, each
    path (``os.PathLike``: a ``pathlib.Path``) its text, each function, class or other callable object its
    :func:`saved_name`, an object with a ``saved_setting()`` method what that returns (a ``WeightedReward``: the
    spec a config gives to build it), and each other dataclass a dict of its fields. Python's yaml writes a tuple with a
    ``!!python/tuple`` tag, and a path or a function with tags of their own, which ``yaml.safe_load`` (TensorBoard's
    hparams reader, a user's script) refuses, as torch.load(weights_only=True) refuses a pickled function, path or
    dataclass. What a run saves of its settings (a logger's hparams.yaml, a checkpoint's hyperparameters), while the
    objects it runs with keep what they were given."""
    if isinstance(value, Mapping):
        return {plain_values(key): plain_yaml_values(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return [plain_yaml_values(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fsdecode(value)
    if not isinstance(value, type) and callable(getattr(type(value), "saved_setting", None)):
        return plain_yaml_values(value.saved_setting())  # the object says how a config spells it (a reward)
    if callable(value):
        return saved_name(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain_yaml_values(getattr(value, field.name)) for field in dataclasses.fields(value)
                if field.init}
    return plain_values(value)


#: How a saved setting (``saved_name``) begins that names a function or object no name imports.
NOT_IMPORTABLE = "<not importable"


def saved_name(value: Callable[..., Any]) -> str:
    """A function, class or other callable object as a saved setting names it: a function or class by
    ``"package.module:qualname"``, the spelling a config gives a reward function or a tool, where that name imports
    it; else a marker that says it cannot be imported and why (a lambda, a local function, one of the script run as
    ``__main__``, which is another program in another process, an object by its class). A marker holds no address,
    so one function saved twice reads the same."""
    if not (inspect.isroutine(value) or inspect.isclass(value)):
        kind = type(value)
        return f"{NOT_IMPORTABLE} (an instance of {kind.__module__}:{kind.__qualname__})>"
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", type(value).__qualname__)
    spelling = f"{module}:{qualname}" if module else qualname
    if "<lambda>" in qualname:
        reason = "a lambda"
    elif "<locals>" in qualname:
        reason = "a local function"
    elif module == "__main__":
        reason = "defined in the script run as __main__"
    elif module is None or getattr(sys.modules.get(module), qualname, None) is not value:
        reason = "not found by that name in its module"
    else:
        return spelling
    return f"{NOT_IMPORTABLE} ({reason}): {spelling}>"


def check_state_keys(what: str, state: Any, keys: Collection[str], optional: Collection[str] = ()) -> Mapping:
    """``state`` if it is a mapping that holds each of ``keys`` (those of ``optional`` may be absent) and no other key,
    else a ValueError saying ``what`` it is (``"a PredictionTrust state"``), the keys missing or unknown and those it
    holds: a checkpoint's state of another object, or of another version, refused before any of it is taken."""
    holds = ", ".join(keys)
    if not isinstance(state, Mapping):
        mapping = f"a mapping of {holds}" if keys else "an empty mapping"
        raise ValueError(f"{what} must be {mapping}, not {type(state).__name__}")
    everyone = len(keys) > 1 and set(keys) <= set(optional)
    absent = "each may be absent" if everyone else f"{' and '.join(optional)} may be absent"
    said = f"it holds {holds or 'nothing'}" + (f" ({absent})" if optional else "")
    missing = [key for key in keys if key not in state and key not in optional]
    if missing:
        raise ValueError(f"{what} lacks {missing}; {said}")
    if unknown := [key for key in state if key not in keys]:
        raise ValueError(f"{what} has unknown keys {shown_keys(unknown)}; {said}")
    return state


def shown_keys(keys: Iterable[Any]) -> str:
    """``keys`` as a list's text, each key as :func:`shown_value` shows it, sorted by their text (a string by
    itself): str() of an int too long to print fails, and a long key would run on."""
    texts = {key: key if isinstance(key, str) else shown_value(key) for key in keys}
    return f"[{', '.join(shown_value(key) for key in sorted(texts, key=texts.__getitem__))}]"


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ValueError naming it: a string such as ``"false"`` is truthy, so taking any
    value as a switch would turn it on."""
    if not isinstance(value, bool):
        raise ValueError(f"{shown_setting(name, value)} must be True or False")
    return value


def check_text(name: str, value: Any, none: bool = False) -> str | None:
    """``value`` if it is a non-empty string (or None where ``none``), else a ValueError naming it."""
    if (value is None and none) or (isinstance(value, str) and value):
        return value
    raise ValueError(f"{shown_setting(name, value)} must be a non-empty string" + (" or None" if none else ""))


def settings_from(name: str, value: Any, cls: type) -> Any:
    """``value`` as a ``cls`` (a settings dataclass): itself, or built from a mapping of its fields, an unknown one
    named with the fields allowed (not the dataclass's TypeError); anything else is a TypeError naming ``name``."""
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        if unknown := [key for key in value if key not in known]:
            raise ValueError(f"unknown {name} options {shown_keys(unknown)}; allowed: {known}")
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"{shown_setting(name, value)} must be a {cls.__name__} or a dict of its fields")
    return value


def check_folder(name: str, value: Any, unset: str) -> Any:
    """``value`` if it is None (``unset`` says what that means) or a folder's path, else a ValueError naming it:
    an empty path would be the current folder."""
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
        raise ValueError(f"{shown_setting(name, value)} must be a folder's path or None ({unset})")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{shown_setting(name, value)} is not known; use one of {list(choices)}")
    return value
