"""Where everything lies in a channel segment: the one home of the slot geometry.

Channel segment (written only by the channel's writer):
    [0, PAGE)                        channel header
    [PAGE, control_size)             one CONTROL_SIZE-byte control block per slot
    slot i at control_size + i * slot_stride:
        [0, HEADER_MAX)              capnp SlotHeader   (per message)
        [LAYOUT_OFFSET, HEADER_AREA) capnp SlotLayout   (per stream)
        [HEADER_AREA, ...)           payload, page aligned, spec.slot_size usable bytes

`ChannelSpec` sizes a segment with these functions (``slot_stride``, ``control_size``);
`SlotGeometry` gives the Writer and every Reader the same absolute offsets per slot.
The byte formats of the channel header, control blocks and lease tables are in `layout`.
"""
from __future__ import annotations

PAGE = 4096
# Room for the capnp SlotHeader and SlotLayout in front of every payload.
HEADER_AREA = 4096
HEADER_MAX = 2048
LAYOUT_OFFSET = HEADER_MAX
LAYOUT_MAX = HEADER_AREA - LAYOUT_OFFSET
CONTROL_SIZE = 64


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_stride(slot_size: int) -> int:
    """Bytes from one slot to the next: header area plus page-aligned payload."""
    return HEADER_AREA + round_up(slot_size, PAGE)


def control_size(slot_count: int) -> int:
    """Channel header page plus one control block per slot, page-aligned."""
    return round_up(PAGE + CONTROL_SIZE * slot_count, PAGE)


def control_offset(slot: int) -> int:
    return PAGE + CONTROL_SIZE * slot


class SlotGeometry:
    """Absolute byte offsets of every slot's parts in one channel's segment.

    ``control[i]``: slot i's control block; ``header[i]``: its SlotHeader (at most
    HEADER_MAX bytes); ``layout[i]``: its SlotLayout (at most LAYOUT_MAX bytes);
    ``payload[i]``: its payload (``slot_size`` bytes). Tuples, indexed on hot paths."""

    __slots__ = ("slot_size", "control", "header", "layout", "payload")

    def __init__(self, spec) -> None:
        base = [control_size(spec.slot_count) + i * slot_stride(spec.slot_size)
                for i in range(spec.slot_count)]
        self.slot_size = spec.slot_size
        self.control = tuple(control_offset(i) for i in range(spec.slot_count))
        self.header = tuple(base)
        self.layout = tuple(b + LAYOUT_OFFSET for b in base)
        self.payload = tuple(b + HEADER_AREA for b in base)

    def payload_views(self, buf: memoryview) -> list[memoryview]:
        """One view of ``slot_size`` bytes per slot payload of a mapped segment."""
        return [buf[p:p + self.slot_size] for p in self.payload]
