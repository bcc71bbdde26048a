"""The tool's argument models, shared by the LangChain and CrewAI tools (both read pydantic
models as a tool's arguments; smolagents' executor takes code, not arguments)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["RunPythonInput", "RunPythonWithFilesInput"]


class RunPythonInput(BaseModel):
    """The tool's only argument."""

    code: str = Field(
        description=(
            "Python 3 source to run. Use print() for what you want to see; the value of the "
            "last expression is returned too."
        )
    )


class RunPythonWithFilesInput(RunPythonInput):
    """The tool's arguments once the operator offered files (`SandboxedPythonTool.offer_file`)."""

    files: list[str] = Field(
        default_factory=list,
        description=(
            "Names of offered files (listed in the tool description) to copy into the working "
            "directory before the code runs; a fresh copy replaces one already there."
        ),
    )
