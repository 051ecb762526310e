"""The ground floor: what every part of the driver needs and that knows nothing of GPUs or of
Kubernetes: bounded, strict decoding of files and values (decoding), atomic durable writes
(durable), the test-only failpoints (failpoints), the commands' exit codes (exit_codes), the
command line's safe output streams (safe_output), output formats and log lines (output_format,
log_format), the version and build_info metric (version, build_info).

May import: nothing of dra_gpu.
"""
