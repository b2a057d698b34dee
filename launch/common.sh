# shellcheck shell=bash
# Sourced by the launch scripts: the jax version this checkout pins (requirements.txt's
# `jax==X` line, the one place it is written) and the install of the jax extra for a
# platform at that version.

# pinned_jax_version ROOT: X of the `jax==X` line in ROOT/requirements.txt.
pinned_jax_version() {
  local version
  version="$(sed -n 's/^jax==\([0-9][0-9.a-z]*\).*$/\1/p' "$1/requirements.txt")"
  [[ -n "$version" ]] || { echo "no 'jax==VERSION' line in $1/requirements.txt" >&2; return 1; }
  echo "$version"
}

# run_in DIR CMD...: runs CMD in DIR, or prints it with DRY_RUN=1.
run_in() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '+ (cd %q &&' "$1"; printf ' %q' "${@:2}"; printf ')\n'
  else
    (cd "$1" && "${@:2}")
  fi
}

# install_venv ROOT VENV EXTRA: creates VENV (relative to ROOT, or absolute) unless it
# has a python, and installs jax[EXTRA]==<pin> and ROOT/requirements.txt into it.
install_venv() {
  local root="$1" venv="$2" extra="$3" version
  version="$(pinned_jax_version "$root")" || return 1
  if ! (cd "$root" && [[ -x "$venv/bin/python" ]]); then
    run_in "$root" python3 -m venv "$venv"
  fi
  run_in "$root" "$venv/bin/pip" install -q -U pip
  run_in "$root" "$venv/bin/pip" install -q "jax[$extra]==$version" -r requirements.txt
}
