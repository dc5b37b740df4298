#!/usr/bin/env bash
# Prints the interpreter that `make ... PYTHON=<name>` sets a venv up with: <name> itself where
# it runs (on PATH, or a path), else pyenv's newest installed version of that minor release
# (`python3.10`: pyenv's shims answer only for the versions selected, so its folder is read).
# Used by the Makefile, so the README's `make test PYTHON=python3.10` works as written on a
# machine whose other Pythons come from pyenv, and CI runs those very commands.
set -u
name=${1:?usage: find_python.sh python3.X}
if found=$(command -v "$name" 2>/dev/null) && "$found" -c "" 2>/dev/null; then
  echo "$found"
  exit 0
fi
minor=${name##*/}
minor=${minor#python}
if [[ $minor =~ ^3\.[0-9]+$ ]] && command -v pyenv >/dev/null 2>&1; then
  found=$(ls -d "$(pyenv root)"/versions/"$minor".*/bin/python"$minor" 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$found" ] && "$found" -c "" 2>/dev/null; then
    echo "$found"
    exit 0
  fi
fi
echo "no Python '$name' on this machine (on PATH, or in pyenv as $minor.*): install it, or pass PYTHON=/path/to/python" >&2
exit 1
