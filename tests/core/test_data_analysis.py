"""The shipped data-analysis policy with the real scientific stack (numpy, pandas, matplotlib)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent_sandbox import Sandbox, Session

pytest.importorskip("numpy")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    sb = Sandbox("data-analysis", warm=0)
    try:
        yield sb.session("analysis")
    finally:
        sb.close()


def test_pandas_and_a_figure_work_without_refusals(session: Session) -> None:
    """It runs numpy, pandas and a matplotlib figure, returns the figure, and nothing fails."""
    result = session.run(
        "import numpy as np, pandas as pd\nimport matplotlib.pyplot as plt\n"
        "df = pd.DataFrame({'x': np.arange(10), 'y': np.arange(10) ** 2})\n"
        "plt.plot(df.x, df.y)\n"
        "df.y.sum()"
    )
    assert result.ok, (result.error, result.denials)
    assert result.value == 285
    assert [image.name for image in result.images] == ["figure-1.png"]
    assert result.images[0].data_base64


def test_library_internal_probes_do_not_fail_the_call(session: Session) -> None:
    """It keeps refusals a library raised and handled itself out of `ok` and `rules()`."""
    result = session.run("import matplotlib.font_manager as fm\nlen(fm.findSystemFonts()) >= 0")
    assert result.ok and result.value is True
    assert all(d.internal for d in result.denials)
    assert result.rules() == []


def test_a_refusal_the_user_code_caught_still_counts(session: Session) -> None:
    """It reports a refusal that reached the user's code even when that code caught it."""
    result = session.run(
        "import pandas as pd\ntry:\n    pd.read_csv('/etc/passwd')\nexcept PermissionError:\n"
        "    caught = True\ncaught"
    )
    assert result.value is True
    assert not result.ok
    assert "files.read" in result.rules()
    assert any(d.target == "/etc/passwd" and not d.internal for d in result.denials)


def test_numpy_values_come_back_as_numbers(session: Session) -> None:
    """It returns numpy scalars as numbers and small numeric arrays as lists."""
    result = session.run("import numpy as np\n[np.int64(3), np.float64(0.5), np.arange(3)]")
    assert result.value == [3, 0.5, [0, 1, 2]]
