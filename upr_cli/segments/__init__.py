"""Segment files (formats/segment.md): one partition's records for one seq range of one branch."""

from upr_cli.segments.format import (
    RECORD_FIELDS,
    BlockInfo,
    Record,
    SegmentError,
    SegmentHeader,
    SegmentInfo,
)
from upr_cli.segments.reader import SegmentReader
from upr_cli.segments.writer import SegmentWriter

__all__ = [
    "RECORD_FIELDS",
    "BlockInfo",
    "Record",
    "SegmentError",
    "SegmentHeader",
    "SegmentInfo",
    "SegmentReader",
    "SegmentWriter",
]
