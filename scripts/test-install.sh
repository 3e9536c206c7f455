#!/usr/bin/env bash
# Installs the CMake build into a temporary prefix, MOVES the prefix elsewhere, then
# configures, builds and runs examples/ as a separate project against the moved copy.
# Proves that the installed package is complete and relocatable, that find_package
# honours the version file, and that the example links the installed library.
#
# Usage: scripts/test-install.sh [build-dir]   (default: build/, configured by `make build`)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
export PATH="$HOME/.cargo/bin:$PATH"

if [[ ! -f "$build/CMakeCache.txt" ]]; then
  echo "test-install: no CMake build in $build (run 'make build' first)" >&2
  exit 1
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
step() { printf '\n== test-install: %s\n' "$*"; }

step "build $build"
cmake --build "$build"

step "install to $work/prefix"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
(cd "$work/prefix" && find . \( -type f -o -type l \) | sort | while read -r f; do
  if [[ -L "$f" ]]; then echo "  $f -> $(readlink "$f")"; else echo "  $f"; fi
done)

step "move the prefix to $work/moved"
mv "$work/prefix" "$work/moved"
if grep -rn "$work/prefix" "$work/moved" >/dev/null 2>&1; then
  echo "test-install: the installed files still name the first prefix:" >&2
  grep -rln "$work/prefix" "$work/moved" >&2
  exit 1
fi
echo "  no installed file names the old prefix"

step "find_package refuses an incompatible version"
mkdir -p "$work/version-check"
cat > "$work/version-check/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.22)
project(version_check NONE)
find_package(kvxfer ${WANT} CONFIG QUIET)
if(kvxfer_FOUND)
  message(STATUS "found kvxfer ${kvxfer_VERSION} for ${WANT}")
else()
  message(STATUS "no kvxfer for ${WANT}")
endif()
CMAKE
check_version() { # want expected(found|none)
  local out
  out="$(cmake -S "$work/version-check" -B "$work/version-check/build-$1" \
    -DCMAKE_PREFIX_PATH="$work/moved" -DWANT="$1" 2>&1)"
  if [[ "$2" == found ]] && ! grep -q "found kvxfer" <<<"$out"; then
    echo "test-install: find_package(kvxfer $1) failed:" >&2; echo "$out" >&2; exit 1
  fi
  if [[ "$2" == none ]] && ! grep -q "no kvxfer" <<<"$out"; then
    echo "test-install: find_package(kvxfer $1) accepted an incompatible version" >&2; exit 1
  fi
  echo "  find_package(kvxfer $1): $2"
}
version="$(sed -n 's/^#define KVXFER_VERSION "\(.*\)"$/\1/p' "$work/moved/include/kvxfer.h")"
major="${version%%.*}"; rest="${version#*.}"; minor="${rest%%.*}"
check_version "$major.$minor" found
check_version "$major.$((minor + 1))" none
check_version "$((major + 1)).0" none

step "configure and build examples/ against the moved prefix"
cmake -S "$root/examples" -B "$work/examples" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/moved" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log" >&2; exit 1; }
grep -- "-- kvxfer" "$work/configure.log" | sed 's/^/  /'
cmake --build "$work/examples" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
lib="$(ldd "$work/examples/room_lifecycle" | awk '/libkvxfer/ {print $3}')"
echo "  room_lifecycle loads $lib"
if [[ "$lib" != "$work/moved/"* ]]; then
  echo "test-install: the example does not load the moved library" >&2
  exit 1
fi

step "run the examples"
"$work/examples/room_lifecycle"
# The main job, small: two processes, real transfers, cancellations, every page verified.
"$work/examples/kv_demo" --requests 24 --concurrency 4 --abort-pct 25 --seed 3

step "passed (installed, moved, found, built and ran against $work/moved; cleaned up)"
