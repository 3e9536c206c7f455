# cmake -DREADELF=... -DLIBRARY=... -DSONAME=... -P check_soname.cmake
#
# Fails unless LIBRARY's dynamic section names SONAME: the SONAME build.rs links in
# must be the one CMakeLists.txt computes and installs links for.
execute_process(
  COMMAND "${READELF}" -d "${LIBRARY}"
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "readelf -d ${LIBRARY} failed (${rc}): ${err}")
endif()
string(REGEX MATCH "Library soname: \\[([^]]*)\\]" _ "${out}")
if(NOT CMAKE_MATCH_1 STREQUAL SONAME)
  message(FATAL_ERROR "${LIBRARY} has SONAME '${CMAKE_MATCH_1}', CMake expects '${SONAME}'")
endif()
message(STATUS "${LIBRARY}: SONAME ${CMAKE_MATCH_1}")
