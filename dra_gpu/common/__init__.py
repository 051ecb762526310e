"""The ground floor: what every part of the driver needs and that knows nothing of GPUs or of
Kubernetes: bounded, strict decoding of files and values (decoding), atomic durable writes
(durable), the test-only failpoints (failpoints), the commands' exit codes (exit_codes) and the
command line's safe output streams (safe_output).

May import: nothing of dra_gpu.
"""
