import pytest

from exporter.chunk_spec import parse_chunk_spec
from exporter.errors import ChunkSpecError


def test_default_spec_covers_22_layers():
    assert parse_chunk_spec("0-6,7-13,14-21", 22) == [(0, 6), (7, 13), (14, 21)]


def test_single_layer_ranges_and_spaces():
    assert parse_chunk_spec(" 0-1, 2 ,3-3", 4) == [(0, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("spec,fragment", [
    ("0-6,8-21", "leaves layers 7-7 uncovered"),
    ("0-6,6-21", "overlaps"),
    ("0-6,7-13,14-22", "goes past the last layer 21"),
    ("0-6,7-13", "leaves layers 14-21 uncovered"),
    ("1-21", "leaves layers 0-0 uncovered"),
    ("0-x", "is not FIRST-LAST"),
    ("5-2,3-21", "is empty or negative"),
    ("", "empty chunk spec"),
    ("0-6,,7-21", "empty chunk spec"),
])
def test_bad_specs_name_the_range_and_layer_count(spec, fragment):
    with pytest.raises(ChunkSpecError) as e:
        parse_chunk_spec(spec, 22)
    msg = str(e.value)
    assert fragment in msg
    assert "22 layers" in msg
    assert "\n" not in msg
