"""The view for a terminal: one line a GPU, fitting `width` columns (80 by default); a GPU's
holders, MIG instances and taints on lines under it. Colours (ANSI) only when asked for: the
command asks when stdout is a terminal and $NO_COLOR is unset."""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Iterable

from dra_gpu.fleet.pending import PendingClaim
from dra_gpu.fleet.view import DomainKind, DomainView, FleetView, GpuState, GpuView, Holder, NodeView, Totals

WIDTH = 80
NAME_COLUMN = 18  # "gpu-0000-18-00-0" and a little more
STATE_COLUMN = 7
_ROW_INDENT = "    "
_SUB_INDENT = " " * (len(_ROW_INDENT) + 3)  # under the device name: room for long pod and claim names
_RESET = "\x1b[0m"
_STYLES = {
    GpuState.FREE: "\x1b[32m",  # green
    GpuState.HELD: "\x1b[36m",  # cyan
    GpuState.SHARED: "\x1b[33m",  # yellow
    GpuState.MIG: "\x1b[35m",  # magenta
    "tainted": "\x1b[1;31m",  # bold red
    "heading": "\x1b[1m",  # bold
}


def memory_text(value: int | None) -> str:
    """Bytes as GiB for a person: 85520809984 -> "79.6Gi"; 21474836480 -> "20Gi"."""
    if value is None:
        return "?"
    if value == 0:
        return "0"
    gib = value / (1 << 30)
    if gib >= 1:
        return f"{gib:.0f}Gi" if gib == int(gib) else f"{gib:.1f}Gi"
    return f"{value / (1 << 20):.0f}Mi"


def short_product(product: str) -> str:
    return product.removeprefix("NVIDIA ")


def totals_text(t: Totals) -> str:
    parts = [f"{t.free} free"]
    parts += [f"{n} {what}" for n, what in ((t.held, "held"), (t.shared, "shared"), (t.mig, "MIG")) if n]
    tainted = f", {t.tainted} tainted" if t.tainted else ""
    return f"{t.gpus} GPU{'s' if t.gpus != 1 else ''}: {', '.join(parts)}{tainted}"


class TextRenderer:
    def __init__(self, width: int = WIDTH, colour: bool = False) -> None:
        self.width = max(40, width)
        self.colour = colour
        self.lines: list[str] = []

    def _style(self, text: str, style: str) -> str:
        return f"{_STYLES[style]}{text}{_RESET}" if self.colour and text else text

    def _fit(self, text: str) -> str:
        """One line of at most `width` columns, control characters shown as "?": slice attributes
        (a product name) are any text a node published, and must not drive the terminal."""
        text = text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)
        return text if len(text) <= self.width else text[: self.width - 1] + "…"

    def _line(self, text: str, style: str | None = None) -> None:
        fitted = self._fit(text)
        self.lines.append(self._style(fitted, style) if style else fitted)

    def render(self, view: FleetView) -> str:
        self.lines = []
        scope = "".join(f" · {k} {v}" for k, v in view.filters.items())
        nodes = len(view.nodes)
        self._line(
            f"dra-gpu top{scope} · {nodes} node{'s' if nodes != 1 else ''} · {totals_text(view.totals)}",
            "heading",
        )
        if not view.nodes:
            self._line("no GPU of the driver matches" if view.filters else "no GPU published by the driver")
        for node in view.nodes:
            self._node(node)
        if view.models:
            self.lines.append("")
            self._line("by model", "heading")
            for product, totals in view.models:
                self._line(f"  {short_product(product):<26} {totals_text(totals)}")
        if view.pending:
            self._pending(view.pending)
        for problem in view.problems:
            self._line(f"left out: {problem}")
        return "\n".join(self.lines) + "\n"

    def _pending(self, pending: tuple[PendingClaim, ...]) -> None:
        self.lines.append("")
        self._line("pending pods: claims not allocated", "heading")
        for p in pending:
            self._line(f"  {p.namespace}/{p.pod} (claim {p.claim})")
            if p.fits:
                where = f"{p.node}: {', '.join(p.devices)}"
                why, style = f"fits now on {where}; not yet placed by the scheduler", None
            elif p.fits is None:
                why, style = p.reason, None
            else:
                why, style = f"cannot fit: {p.reason}", "tainted"
            for line in textwrap.wrap(why, self.width - len(_SUB_INDENT)) or [""]:
                self._line(f"{_SUB_INDENT}{line}", style)

    def _node(self, node: NodeView) -> None:
        self.lines.append("")
        self._line(f"{node.name}  {totals_text(node.totals)}", "heading")
        for domain in node.domains:
            self._line(f"  {domain_heading(domain)}")
            for gpu in domain.gpus:
                self._gpu(gpu)

    def _gpu(self, gpu: GpuView) -> None:
        index = f"{gpu.index:>2}" if gpu.index is not None else " ?"
        head = f"{_ROW_INDENT}{index} {gpu.name:<{NAME_COLUMN}} "
        detail, subs = _detail(gpu)
        row = f"{head}{gpu.state.value:<{STATE_COLUMN}} {detail}".rstrip()
        if len(row) > self.width and gpu.state is GpuState.HELD:  # its holder on a line of its own
            row, subs = f"{head}{gpu.state.value:<{STATE_COLUMN}} {memory_text(gpu.memory)}", [detail, *subs]
        plain = self._fit(row)
        word, at = gpu.state.value, len(head)
        if self.colour and plain[at : at + len(word)] == word:  # colour the state word only
            plain = plain[:at] + self._style(word, gpu.state) + plain[at + len(word) :]
        self.lines.append(plain)
        for sub in subs:
            self._line(f"{_SUB_INDENT}{sub}")
        if gpu.mig is not None:
            self._wrapped("free: ", [f"{p} x{n}" for p, n in gpu.mig.free] or ["none"])
        for taint in gpu.taints:
            source = taint.source.replace("DeviceTaintRule ", "rule ")
            self._line(f"{_SUB_INDENT}tainted {taint.text()} ({source})", "tainted")

    def _wrapped(self, label: str, items: list[str]) -> None:
        """`label` and the items, on as many lines as they take."""
        line = f"{_SUB_INDENT}{label}"
        for i, item in enumerate(items):
            text = item + ("," if i < len(items) - 1 else "")
            if len(line) + 1 + len(text) > self.width and line.strip() != label.strip():
                self._line(line)
                line = _SUB_INDENT + " " * len(label) + text
            else:
                line += ("" if line.endswith(label) else " ") + text
        self._line(line)


def domain_heading(domain: DomainView) -> str:
    products = Counter(short_product(g.product) for g in domain.gpus)
    models = ", ".join(f"{n}x {p}" for p, n in products.items())
    states = totals_text(Totals.of(domain.gpus)).partition(": ")[2]
    if domain.kind is DomainKind.NVLINK:
        return f"NVLink {domain.domain} · {models} · {states}"
    if domain.kind is DomainKind.MIG:
        return f"MIG mode · {models}"
    return f"no NVLink · {models} · {states}"


def _holder_text(h: Holder) -> str:
    pending = [p for p in h.pods if p.phase and p.phase != "Running"]
    phase = f" [{pending[0].phase}]" if pending else ""
    daemons = "".join(
        f", MPS daemon {d.name}" + (f" [{d.phase}]" if d.phase != "Running" else "") for d in h.mps_daemons
    )
    return f"{h.owner}{phase} (claim {h.claim}{daemons})"


def _detail(gpu: GpuView) -> tuple[str, list[str]]:
    """The text after the state, and the lines under the GPU."""
    if gpu.mig is not None:
        mig = gpu.mig
        subs = [f"{i.profile:<8} {_holders_text(i.holders)}" for i in mig.used]
        if mig.dynamic:  # placements: made when allocated, so only the used ones exist
            slices = f" · {mig.slices_used}/{mig.slices_total} memory slices" if mig.slices_total else ""
            return f"{len(mig.used)} in use{slices}", subs
        made = len(mig.used) + sum(n for _, n in mig.free)
        return f"{len(mig.used)}/{made} instances in use", subs
    if gpu.state is GpuState.SHARED:
        shares = f"{len(gpu.holders)} share{'s' if len(gpu.holders) != 1 else ''}"
        subs = [f"{memory_text(h.memory):>7} {_holder_text(h)}" for h in gpu.holders]
        return f"{shares}, {memory_text(gpu.free_memory)} of {memory_text(gpu.memory)} free", subs
    if gpu.state is GpuState.HELD:
        return _holders_text(gpu.holders), []
    return memory_text(gpu.memory), []  # free


def _holders_text(holders: Iterable[Holder]) -> str:
    return "; ".join(_holder_text(h) for h in holders)


def render_text(view: FleetView, width: int = WIDTH, colour: bool = False) -> str:
    return TextRenderer(width, colour).render(view)
