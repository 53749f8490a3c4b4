"""Reading and writing the text formats of extreme classification data."""

from .ingest import ingest, read_text
from .parse import FORMATS, ParseError
from .transforms import NORMALIZATIONS, transform_rows

__all__ = ["FORMATS", "NORMALIZATIONS", "ParseError", "ingest", "read_text", "transform_rows"]
