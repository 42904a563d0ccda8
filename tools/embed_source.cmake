# Writes OUTPUT: a C++ include that defines kTrainerSource, the trainer's full source (train_gpt.cu,
# then every header of kernels/, kernels/host/ and data/), each file headed by its path, so the run log carries
# the exact code that produced it (as the reference logs its script).
# Usage: cmake -DSOURCE_DIR=<repo> -DOUTPUT=<file> -P embed_source.cmake
file(GLOB headers RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/kernels/*.cuh ${SOURCE_DIR}/kernels/host/*.cuh
     ${SOURCE_DIR}/kernels/host/*.h ${SOURCE_DIR}/data/*.h)
list(SORT headers)
set(bytes "")
foreach(path train_gpt.cu ${headers})
  file(READ ${SOURCE_DIR}/${path} content HEX)
  string(HEX "// ===== ${path} =====\n" banner)
  string(APPEND bytes "${banner}${content}")
endforeach()
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${bytes}")
string(RANDOM LENGTH 12 run)  # a temporary file of this run's own (builds side by side)
file(WRITE ${OUTPUT}.${run}.tmp "static const char kTrainerSource[] = {${bytes}0x00};\n")
file(RENAME ${OUTPUT}.${run}.tmp ${OUTPUT})
