"""bench/common.py: what every suite writes."""
import json

import pytest

from trainstream_hf.bench import common


def test_a_write_that_fails_midway_keeps_the_previous_json_whole(tmp_path):
    """The table rewrites its JSON after each row; a write cut short must not leave a torn file."""
    path = common.write_json("t", {"results": [{"row": "a"}]}, str(tmp_path))
    before = (tmp_path / "t.json").read_text()
    with pytest.raises(TypeError):  # json.dump fails after writing part of the file
        common.write_json("t", {"results": [{"row": "a"}, {"row": object()}]}, str(tmp_path))
    assert (tmp_path / "t.json").read_text() == before and json.loads(before)["results"] == [{"row": "a"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"] and path.endswith("t.json")
