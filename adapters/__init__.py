"""Agent-framework adapters. Framework imports stay inside `langchain` and `crewai`."""

__all__: list[str] = []
