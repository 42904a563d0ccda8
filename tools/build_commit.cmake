# Writes OUTPUT: a C++ include that defines kBuildCommit, where the trainer is built from for its
# run log: "commit <hash>", with ", tree dirty" where tracked files differ from it (", tree state
# unknown" where git cannot tell), or "not from a git checkout". Runs at every build; OUTPUT is rewritten only when its text changes, so a build at
# the same commit recompiles nothing.
# Usage: cmake -DSOURCE_DIR=<repo> -DOUTPUT=<file> -P build_commit.cmake
find_package(Git QUIET)
set(origin "not from a git checkout")
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} rev-parse HEAD RESULT_VARIABLE failed
                  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT failed)
    # --no-optional-locks: a build beside a `git commit` must not take the index's lock from it
    execute_process(COMMAND ${GIT_EXECUTABLE} --no-optional-locks -C ${SOURCE_DIR} status --porcelain
                            --untracked-files=no
                    RESULT_VARIABLE status_failed OUTPUT_VARIABLE changes ERROR_QUIET)
    set(origin "commit ${commit}")
    if(status_failed)
      string(APPEND origin ", tree state unknown")
    elseif(changes)
      string(APPEND origin ", tree dirty")
    endif()
  endif()
endif()
# a temporary file of this run's own: builds started side by side (a node's ranks) share OUTPUT's folder
string(RANDOM LENGTH 12 run)
file(WRITE ${OUTPUT}.${run}.tmp "static const char kBuildCommit[] = \"${origin}\";\n")
file(COPY_FILE ${OUTPUT}.${run}.tmp ${OUTPUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUTPUT}.${run}.tmp)
