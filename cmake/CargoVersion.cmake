# kvxfer_cargo_version(<toml> <out_var>)
#
# Reads `version = "x.y.z"` from the [package] section of the Cargo.toml at <toml> and
# stores "x.y.z" in <out_var> (a pre-release or build suffix is dropped: CMake versions
# are numeric). Cargo.toml is the one version source; CMake only reads it.
function(kvxfer_cargo_version toml out_var)
  file(READ "${toml}" _text)
  string(FIND "${_text}" "\n[package]" _at)
  if(_at LESS 0)
    string(FIND "${_text}" "[package]" _at)
    if(NOT _at EQUAL 0)
      message(FATAL_ERROR "${toml}: no [package] section")
    endif()
  endif()
  string(SUBSTRING "${_text}" ${_at} -1 _text)
  string(FIND "${_text}" "]" _close)
  math(EXPR _close "${_close} + 1")
  string(SUBSTRING "${_text}" ${_close} -1 _section)
  # The section ends where the next table header starts.
  string(FIND "${_section}" "\n[" _end)
  if(_end GREATER_EQUAL 0)
    string(SUBSTRING "${_section}" 0 ${_end} _section)
  endif()
  string(REGEX MATCH "\n[ \t]*version[ \t]*=[ \t]*\"([0-9]+\\.[0-9]+\\.[0-9]+)[^\"]*\""
         _match "${_section}")
  if(NOT _match)
    message(FATAL_ERROR "${toml}: no `version = \"x.y.z\"` in the [package] section")
  endif()
  set(${out_var} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()
