#pragma once

#include <string>
#include <vector>

namespace layoutlang::nccl {

// Runs the C++ checks of the communicator over NcclMock; returns one message per failure.
std::vector<std::string> run_self_tests();

}  // namespace layoutlang::nccl
