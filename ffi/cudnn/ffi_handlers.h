// The XLA FFI handlers of the cuDNN paged prefill (stages of one custom call target) and the
// state type they share, as plain pointers for the Python module to wrap in capsules.
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

namespace jaxattn::cudnn {

XLA_FFI_Error* PagedPrefillInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedPrefillInitialize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedPrefillExecute(XLA_FFI_CallFrame* call_frame);

// XLA_FFI_TypeId and XLA_FFI_TypeInfo of the per-call-site state (register before the handlers).
void* PagedPrefillStateTypeId();
void* PagedPrefillStateTypeInfo();

// How many times the execute stage's host code ran in this process (tests use it to show that
// a command buffer replays the call without running it).
int64_t PagedPrefillExecuteCount();

}  // namespace jaxattn::cudnn
