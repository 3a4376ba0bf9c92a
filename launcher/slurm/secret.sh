# Sourced by the sbatch scripts: the run secret (docs/SECURITY.md), a file of mode 0600 on the shared file system,
# passed to every process by path (never on a command line). 32 random bytes as hex, as `dilocox secret` writes
# them; noclobber: an existing file is never overwritten (another job step may have written it first).
#   SECRET=$(dilocox_secret_file "$RUN/secret") || exit 2     (prints the absolute path)
dilocox_secret_file() {
  local path=$1 key
  if [[ ! -e $path ]]; then
    key=$(od -An -vtx1 -N32 /dev/urandom | tr -d ' \n')
    if [[ ${#key} -ne 64 ]]; then echo "could not read 32 random bytes for $path" >&2; return 2; fi
    if ! ( umask 077 && set -o noclobber && printf '%s\n' "$key" > "$path" ) 2>/dev/null && [[ ! -s $path ]]; then
      echo "could not write the run secret $path (its directory must exist and be writable)" >&2
      return 2
    fi
  fi
  echo "$(cd "$(dirname "$path")" && pwd)/$(basename "$path")"
}
