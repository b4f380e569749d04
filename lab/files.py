"""The files of runs and reports, on a local disk or in a bucket (gs://bucket/run) alike.

Every file a run or a report reads or writes goes through `etils.epath` (orbax and TensorBoard
take the same paths through their own cloud support), so a workdir or an `--out` on cloud
storage needs no mounted filesystem. Two things differ there and are handled here: an object
cannot be appended to (`append_lines` rewrites it whole) or renamed atomically over another
(`replace_text` writes it in place, which a bucket makes atomic per object).
"""

from __future__ import annotations

import io

from etils import epath


def path(p) -> epath.Path:
    return epath.Path(p)


def is_local(p) -> bool:
    """Whether `p` is a path on this machine's filesystem (not a URI such as gs://bucket/x)."""
    return "://" not in str(p)


def join(*parts) -> str:
    """The parts joined as a path string (a URI stays a URI)."""
    return str(path(parts[0]).joinpath(*parts[1:]))


def read_text(p) -> str:
    return path(p).read_text()


def write_text(p, text: str) -> None:
    """Write `text` to `p`, its folder made if missing."""
    p = path(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def replace_text(p, text: str) -> None:
    """Replace the content of `p` with `text` in one step: a reader sees the old file or the new
    one, never a part (locally a rename over it; in a bucket an object write is atomic)."""
    if not is_local(p):
        return write_text(p, text)
    tmp = path(f"{p}.tmp")
    tmp.write_text(text)
    tmp.replace(path(p))


def append_lines(p, lines: list[str]) -> None:
    """Append whole lines ('\\n'-terminated) to `p` (an object in a bucket is rewritten whole)."""
    p = path(p)
    if is_local(p):
        with p.open("a") as f:
            f.writelines(lines)
    else:
        write_text(p, (p.read_text() if p.exists() else "") + "".join(lines))


def save_figure(fig, p, **kwargs) -> None:
    """A matplotlib figure saved as `p` (format from its suffix)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path(p).suffix.lstrip(".") or "png", **kwargs)
    path(p).parent.mkdir(parents=True, exist_ok=True)
    path(p).write_bytes(buffer.getvalue())
