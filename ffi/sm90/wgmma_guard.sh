#!/bin/sh
# Compiler launcher of the Hopper kernels: runs one nvcc command and fails it when ptxas reports
# that it serialised a kernel's wgmmas or injected waits between them (infos C7510-C7519).
# Those are infos, not warnings, so the build would otherwise pass while the kernel loses its
# overlap of tensor-core work with the softmax (once, a call the compiler did not inline made a
# forward kernel ten times slower).
log=$(mktemp) || exit 1
"$@" > "$log" 2>&1
status=$?
cat "$log"
if grep -q '(C751[0-9])' "$log"; then
  echo "error: ptxas serialised wgmmas (C751x above); every Hopper kernel must keep them" \
       "asynchronous" >&2
  status=1
  # The object nvcc wrote would look up to date to the next build: remove it.
  output=""
  previous=""
  for arg in "$@"; do
    [ "$previous" = "-o" ] && output=$arg
    previous=$arg
  done
  [ -n "$output" ] && rm -f "$output"
fi
rm -f "$log"
exit $status
