# Fails unless ACTUAL --help prints what EXPECTED --help prints, program path aside.
# Usage: cmake -DEXPECTED=<program> -DACTUAL=<program> -P same_help.cmake
foreach(which EXPECTED ACTUAL)
  execute_process(COMMAND ${${which}} --help OUTPUT_VARIABLE text RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${${which}} --help exited with ${rc}")
  endif()
  string(REPLACE "${${which}}" "PROGRAM" help_${which} "${text}")
endforeach()
if(NOT help_EXPECTED STREQUAL help_ACTUAL)
  message(FATAL_ERROR "--help differs:\n${help_EXPECTED}\n---- against ----\n${help_ACTUAL}")
endif()
message(STATUS "same --help text from ${ACTUAL}")
