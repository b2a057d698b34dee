# shellcheck shell=bash
# Sourced by the launch scripts: the jax version this checkout pins (requirements.txt's
# `jax==X` line, the one place it is written), the install of the jax extra for a
# platform at that version, and the command-line parsing every script shares.

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

# --- Command lines ---------------------------------------------------------------------
# Each script sets PROG (its name, for errors) and OPTIONS (its flags), defines `usage`,
# then calls `parse_args "$@"`. An OPTIONS entry is
#   --flag=VAR      a value, `--flag V` or `--flag=V`, stored in VAR;
#   --flag=+VAR     the same, and VAR is exported (NCCL's variables);
#   --flag=VAR=V    a switch: `--flag` sets VAR to V.
# COMMON_OPTIONS are every script's. Everything after `--`, and any --config.* flag,
# goes to main.py (EXTRA; `main_py_args` puts it after --config and --workdir).
# shellcheck disable=SC2034  # read by the scripts that source this file
COMMON_OPTIONS=(--config=CONFIG --workdir=WORKDIR --data_dir=DATA_DIR --dry_run=DRY_RUN=1)

# die MSG...: the one-line error of a misused command (exit status 2).
die() { echo "${PROG:-launch}: $*" >&2; exit 2; }

# require VAR FLAG [ENV]: dies unless VAR, set by FLAG or the environment variable ENV
# (default: VAR), is non-empty.
require() { [[ -n "${!1:-}" ]] || die "$2 (or ${3:-$1}) is required"; }

# _option FLAG: the OPTIONS entry's right-hand side for FLAG; status 1 if none.
_option() {
  local entry
  for entry in "${OPTIONS[@]}"; do
    if [[ "${entry%%=*}" == "$1" ]]; then
      echo "${entry#*=}"
      return 0
    fi
  done
  return 1
}

# parse_args ARGS...: sets the OPTIONS variables and EXTRA from ARGS; -h/--help prints
# `usage` and exits 0; an unknown flag or a missing value is a one-line error.
parse_args() {
  EXTRA=()
  local arg flag spec var value
  while [[ $# -gt 0 ]]; do
    arg="$1"
    shift
    case "$arg" in
      -h|--help) usage; exit 0 ;;
      --) EXTRA+=("$@"); return 0 ;;
      --config.*) EXTRA+=("$arg"); continue ;;
    esac
    flag="${arg%%=*}"
    spec="$(_option "$flag")" || die "unknown argument '$arg' (see --help)"
    var="${spec#+}"
    if [[ "$var" == *=* ]]; then                       # a switch
      [[ "$arg" == "$flag" ]] || die "unknown argument '$arg' (see --help)"
      printf -v "${var%%=*}" '%s' "${var#*=}"
      continue
    fi
    if [[ "$arg" == *=* ]]; then
      value="${arg#*=}"
    else
      [[ $# -ge 1 && -n "$1" ]] || die "$flag needs a value"
      value="$1"
      shift
    fi
    printf -v "$var" '%s' "$value"
    if [[ "$spec" == +* ]]; then
      export "${var?}"
    fi
  done
}

# main_py_args: MAIN_ARGS, main.py's flags: --config, --workdir, the data directory
# (when DATA_DIR is set) and EXTRA.
main_py_args() {
  MAIN_ARGS=(--config="$CONFIG" --workdir="$WORKDIR")
  if [[ -n "$DATA_DIR" ]]; then
    MAIN_ARGS+=(--config.data.data_dir="$DATA_DIR")
  fi
  MAIN_ARGS+=("${EXTRA[@]}")
}

# preflight ROOT TARGET PYTHON: compiles the run's train step (CONFIG and its --config.*
# overrides in EXTRA) for TARGET on this machine's CPU with PYTHON
# (`python -m odetransformer.memory --compile_for=TARGET`; the compilers come from
# requirements-compile.txt) and dies unless it compiles and fits. Prints the command
# with DRY_RUN=1.
preflight() {
  local root="$1" target="$2" py="$3" overrides=() arg
  for arg in "${EXTRA[@]+"${EXTRA[@]}"}"; do
    [[ "$arg" == --config.* ]] && overrides+=("$arg")
  done
  echo "pre-flight: compiling the train step of $CONFIG for $target on this CPU" \
       "(--skip_preflight skips it)"
  if ! run_in "$root" "$py" -m odetransformer.memory --config="$CONFIG" \
      --compile_for="$target" "${overrides[@]+"${overrides[@]}"}"; then
    die "refusing to launch: the pre-flight for $target failed (its error is above);" \
        "change the config, or pass --skip_preflight"
  fi
}
