"""dra-gpu's version, in one place below every package that reports it (the build_info metric,
`dra-gpu --version` falls back to the installed distribution's); pyproject.toml's is the same."""

VERSION = "0.1.0"
