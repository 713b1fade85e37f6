// JNI bridge: the Kotlin core's ExecuTorch MethodBackend on the JVM (org.zerolock.core.executorch).
//
// Runs a zl-export chunk (program .pte + weights .ptd) through ExecuTorch's C++ runtime from the
// executorch wheel (libexecutorch.so and friends). Every misuse the Kotlin side can make comes back
// as a Java exception naming the problem; nothing here may abort the JVM, so inputs are checked
// against the method's own metadata before ExecuTorch sees them (its kernels ET_CHECK and abort).
//
// Memory: each method's inputs are copied once into native buffers that belong to the method and
// are reused run after run. Outputs the caller asks to keep stay where ExecuTorch wrote them (the
// method's planned arena) and are fed to a later method by reference: phase 1's saved activations
// reach phase 2 without ever crossing into the JVM heap. A kept output is valid until its method
// runs again; a stale reference is refused (the generation check below).
#include <jni.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

// The wheel ships no extension/threadpool/threadpool.h (nor the pthreadpool.h it includes);
// libexecutorch_threadpool.so exports these members, so declaring the two we call is enough.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace {

using executorch::aten::ScalarType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;
using executorch::runtime::Error;
using executorch::runtime::Tag;

// A failure to report to Java: the exception class and a one-line message.
struct JavaError {
  const char* cls;
  std::string msg;
};
const char* kIllegalArgument = "java/lang/IllegalArgumentException";
const char* kIllegalState = "java/lang/IllegalStateException";

[[noreturn]] void fail(const char* cls, std::string msg) { throw JavaError{cls, std::move(msg)}; }

std::string et_error(Error e) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "ExecuTorch error 0x%x", static_cast<unsigned>(e));
  return buf;
}

// The wire dtype codes of docs/PROTOCOL.md 4.1 (org.zerolock.core.protocol.DType).
struct DTypeInfo {
  int code;
  ScalarType scalar;
  size_t item;
  const char* name;
};
const DTypeInfo kDTypes[] = {
    {1, ScalarType::Float, 4, "float32"}, {2, ScalarType::Half, 2, "float16"}, {3, ScalarType::BFloat16, 2, "bfloat16"},
    {4, ScalarType::Long, 8, "int64"},    {5, ScalarType::Int, 4, "int32"},    {6, ScalarType::Byte, 1, "uint8"},
    {7, ScalarType::Bool, 1, "bool"},
};
const DTypeInfo* by_code(int code) {
  for (const auto& d : kDTypes)
    if (d.code == code) return &d;
  return nullptr;
}
const DTypeInfo* by_scalar(ScalarType t) {
  for (const auto& d : kDTypes)
    if (d.scalar == t) return &d;
  return nullptr;
}
std::string scalar_name(ScalarType t) {
  const DTypeInfo* d = by_scalar(t);
  return d ? d->name : "ExecuTorch dtype " + std::to_string(static_cast<int>(t));
}
template <class Seq>
std::string shape_str(const Seq& s) {
  std::string out = "[";
  bool first = true;
  for (auto d : s) {
    if (!first) out += ", ";
    out += std::to_string(d);
    first = false;
  }
  return out + "]";
}

// ---- runtime set-up: log sink and thread pool, once per process ----------------------------------
bool g_verbose = false;

void log_sink(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
              const char* message, size_t length) {
  // Info lines (cpuinfo's missing midr files, pool sizes) are noise on a phone's stderr
  if (!g_verbose && level != kError && level != kFatal) return;
  const char* base = std::strrchr(filename, '/');
  std::fprintf(stderr, "[executorch %c %s:%zu] %.*s\n", static_cast<char>(level), base ? base + 1 : filename, line,
               static_cast<int>(length), message);
}

std::once_flag g_init;
void init_once() {
  std::call_once(g_init, [] {
    executorch::runtime::register_pal(executorch::runtime::PalImpl::create(log_sink, __FILE__));
    executorch::runtime::runtime_init();
  });
}

// ---- one loaded program -----------------------------------------------------------------------
struct MethodState {
  std::vector<std::vector<uint8_t>> in_bufs;  // reused input copies, one per input slot
  std::vector<EValue> outputs;                // the last run's outputs (views of the arena)
  long long generation = 0;                   // runs so far: a kept output names the run it came from
};

struct Program {
  std::unique_ptr<Module> module;
  bool shared_arenas = false;  // methods share memory ids 1 and 2 (outputs_planned_apart)
  std::map<std::string, MethodState> methods;
  std::mutex mu;  // Module is not thread-safe
};

MethodState& method_state(Program& p, const std::string& method) {
  auto it = p.methods.find(method);
  if (it != p.methods.end()) return it->second;
  auto names = p.module->method_names();
  if (!names.ok()) fail(kIllegalState, "cannot list the program's methods (" + et_error(names.error()) + ")");
  if (!names->count(method)) {
    std::string have;
    for (const auto& n : *names)
      if (n.rfind("__", 0) != 0) have += (have.empty() ? "" : ", ") + n;
    fail(kIllegalArgument, "the program has no method '" + method + "' (it has: " + have + ")");
  }
  Error e = p.module->load_method(method);
  if (e != Error::Ok) fail(kIllegalState, "could not load method '" + method + "' (" + et_error(e) + ")");
  return p.methods[method];
}

// Whether the program plans phase 1's outputs in a memory id above the two a Module shares across
// methods (zl-export's PHASE1_OUTPUTS_MEM_ID = 3; tests/test_export_programs.py checks the two agree), so that
// sharing cannot overwrite what phase 2 reads.
bool outputs_planned_apart(Module& m) {
  constexpr size_t kOutputsMemId = 3;
  auto meta = m.method_meta("phase1");
  // MethodMeta hides the reserved memory id 0: buffer index i is memory id i + 1
  if (!meta.ok() || meta->num_memory_planned_buffers() < kOutputsMemId) return false;
  auto size = meta->memory_planned_buffer_size(kOutputsMemId - 1);
  return size.ok() && *size > 0;
}

// ---- JNI helpers ------------------------------------------------------------------------------
std::string jstr(JNIEnv* env, jstring s) {
  if (s == nullptr) fail(kIllegalArgument, "null string");
  const char* c = env->GetStringUTFChars(s, nullptr);
  std::string out(c ? c : "");
  if (c) env->ReleaseStringUTFChars(s, c);
  return out;
}

void throw_java(JNIEnv* env, const char* cls, const std::string& msg) {
  if (env->ExceptionCheck()) return;  // one already pending says more
  jclass c = env->FindClass(cls);
  if (c) env->ThrowNew(c, msg.c_str());
}

template <class F>
auto guarded(JNIEnv* env, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const JavaError& e) {
    throw_java(env, e.cls, e.msg);
  } catch (const std::bad_alloc&) {
    throw_java(env, "java/lang/OutOfMemoryError", "native memory exhausted in the ExecuTorch bridge");
  } catch (const std::exception& e) {
    throw_java(env, kIllegalState, std::string("ExecuTorch bridge: ") + e.what());
  }
  return decltype(f())();
}

Program* program_of(jlong handle) {
  if (handle == 0) fail(kIllegalState, "the program was closed");
  return reinterpret_cast<Program*>(handle);
}

}  // namespace

// Kotlin: org.zerolock.core.executorch.EtNative (top-level external funs, @file:JvmName("EtNative")).
extern "C" {

JNIEXPORT jstring JNICALL Java_org_zerolock_core_executorch_EtNative_nInitRuntime(JNIEnv* env, jclass, jint threads,
                                                                              jboolean verbose) {
  return guarded(env, [&]() -> jstring {
    g_verbose = verbose;
    init_once();
    auto* pool = executorch::extension::threadpool::get_threadpool();
    if (threads < 0) fail(kIllegalArgument, "threads must be >= 0 (0: the pool's default size)");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    if (threads > 0 && static_cast<size_t>(threads) != pool->get_thread_count() &&
        !pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads)))
      fail(kIllegalState, "could not resize ExecuTorch's thread pool to " + std::to_string(threads));
#pragma GCC diagnostic pop
    std::string s = "backends:";
    size_t nb = executorch::runtime::get_num_registered_backends();
    for (size_t i = 0; i < nb; ++i) {
      auto name = executorch::runtime::get_backend_name(i);
      s += std::string(" ") + (name.ok() ? *name : "?");
    }
    s += "; kernels: " + std::to_string(executorch::runtime::get_registered_kernels().size());
    s += "; threads: " + std::to_string(pool->get_thread_count());
    return env->NewStringUTF(s.c_str());
  });
}

JNIEXPORT jlong JNICALL Java_org_zerolock_core_executorch_EtNative_nLoad(JNIEnv* env, jclass, jstring jpte,
                                                                     jstring jptd) {
  return guarded(env, [&]() -> jlong {
    init_once();
    std::string pte = jstr(env, jpte);
    auto p = std::make_unique<Program>();
    // One working arena for all methods (memory ids 1 and 2) where the export allows it: phase 2
    // then reuses what phase 1 worked in. Phase 1's outputs, which phase 2 reads by reference, must
    // then lie in an id of their own (zl-export's PHASE1_OUTPUTS_MEM_ID), which stays phase 1's;
    // an older export keeps them in id 1, so its methods keep separate arenas.
    auto open = [&](bool share) {
      return jptd != nullptr ? std::make_unique<Module>(pte, jstr(env, jptd), Module::LoadMode::Mmap, nullptr,
                                                        nullptr, nullptr, share)
                             : std::make_unique<Module>(pte, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, share);
    };
    // The arenas are the Module's constructor argument and the plan is read from a loaded program:
    // the first open maps the file and parses its header only (no method loaded), so opening it
    // again costs little.
    p->module = open(false);
    Error e = p->module->load();
    if (e == Error::Ok && outputs_planned_apart(*p->module)) {
      p->module = open(true);
      p->shared_arenas = true;
      e = p->module->load();
    }
    if (e != Error::Ok)
      fail(kIllegalArgument, "could not load " + pte + (jptd ? " with its weights " + jstr(env, jptd) : "") + " (" +
                                 et_error(e) + "): not an ExecuTorch program, or weights of another export");
    // load every method now: weights of another export fail here, at STAGE_ASSIGN, not mid-run
    auto names = p->module->method_names();
    if (!names.ok()) fail(kIllegalArgument, "cannot list the methods of " + pte + " (" + et_error(names.error()) + ")");
    for (const auto& m : *names) {
      if (m.rfind("__", 0) == 0) continue;  // ExecuTorch's training metadata methods
      Error le = p->module->load_method(m);
      if (le != Error::Ok)
        fail(kIllegalArgument, "could not load method '" + m + "' of " + pte + (jptd ? " with " + jstr(env, jptd) : "") +
                                   " (" + et_error(le) + "): the weights are not this program's; re-push both from one export");
      p->methods[m];
    }
    return reinterpret_cast<jlong>(p.release());
  });
}

JNIEXPORT void JNICALL Java_org_zerolock_core_executorch_EtNative_nClose(JNIEnv*, jclass, jlong handle) {
  delete reinterpret_cast<Program*>(handle);
}

JNIEXPORT jobjectArray JNICALL Java_org_zerolock_core_executorch_EtNative_nMethodNames(JNIEnv* env, jclass,
                                                                                   jlong handle) {
  return guarded(env, [&]() -> jobjectArray {
    Program* p = program_of(handle);
    std::lock_guard<std::mutex> lock(p->mu);
    auto names = p->module->method_names();
    if (!names.ok()) fail(kIllegalState, "cannot list the program's methods (" + et_error(names.error()) + ")");
    jobjectArray out = env->NewObjectArray(static_cast<jsize>(names->size()), env->FindClass("java/lang/String"), nullptr);
    jsize i = 0;
    for (const auto& n : *names) env->SetObjectArrayElement(out, i++, env->NewStringUTF(n.c_str()));
    return out;
  });
}

JNIEXPORT jboolean JNICALL Java_org_zerolock_core_executorch_EtNative_nSharedArenas(JNIEnv* env, jclass, jlong handle) {
  return guarded(env, [&]() -> jboolean { return program_of(handle)->shared_arenas ? JNI_TRUE : JNI_FALSE; });
}

// Runs `method`. Input i is inData[i] (a byte[] or a direct ByteBuffer, copied into the method's
// reused buffer) of wire dtype inDtype[i] and shape inShape[i]; or, where inData[i] is null, output
// keptIndex[i] of the last run of `keptMethod`, which must be run number keptGeneration of it.
// Returns [generation (long[1]), then per output: long[] {dtype, dims...}, byte[] or null]: outputs
// with keep[i] set stay in ExecuTorch's memory (null here) for a later method to take by reference.
JNIEXPORT jobjectArray JNICALL Java_org_zerolock_core_executorch_EtNative_nRun(
    JNIEnv* env, jclass, jlong handle, jstring jmethod, jobjectArray inData, jintArray inDtype, jobjectArray inShape,
    jintArray keptIndex, jstring jkeptMethod, jlong keptGeneration, jbooleanArray keep) {
  return guarded(env, [&]() -> jobjectArray {
    Program* p = program_of(handle);
    std::string method = jstr(env, jmethod);
    std::lock_guard<std::mutex> lock(p->mu);
    MethodState& st = method_state(*p, method);
    auto meta = p->module->method_meta(method);
    if (!meta.ok()) fail(kIllegalState, "no metadata for method '" + method + "' (" + et_error(meta.error()) + ")");
    const size_t n = static_cast<size_t>(env->GetArrayLength(inData));
    if (n != meta->num_inputs())
      fail(kIllegalArgument, method + " takes " + std::to_string(meta->num_inputs()) + " inputs, got " +
                                 std::to_string(n));
    if (static_cast<size_t>(env->GetArrayLength(inDtype)) != n || static_cast<size_t>(env->GetArrayLength(inShape)) != n ||
        static_cast<size_t>(env->GetArrayLength(keptIndex)) != n)
      fail(kIllegalArgument, "inData, inDtype, inShape and keptIndex must have one entry per input");
    std::vector<jint> dtypes(n), kept(n);
    env->GetIntArrayRegion(inDtype, 0, static_cast<jsize>(n), dtypes.data());
    env->GetIntArrayRegion(keptIndex, 0, static_cast<jsize>(n), kept.data());

    MethodState* from = nullptr;  // the method whose kept outputs this run reads
    if (jkeptMethod != nullptr) {
      std::string km = jstr(env, jkeptMethod);
      if (km == method) fail(kIllegalArgument, method + " cannot read its own kept outputs (running it replaces them)");
      auto it = p->methods.find(km);
      if (it == p->methods.end() || it->second.generation == 0)
        fail(kIllegalState, method + " reads outputs of " + km + ", which has not run");
      from = &it->second;
      if (from->generation != keptGeneration)
        fail(kIllegalState, method + " reads outputs of " + km + " run " + std::to_string(keptGeneration) + ", but " + km +
                                " has run since (run " + std::to_string(from->generation) +
                                "): its kept outputs are gone; run each phase 2 before the next phase 1");
    }
    st.in_bufs.resize(n);
    std::vector<TensorPtr> hold;  // the TensorImpl wrappers live until execute returns
    std::vector<EValue> args;
    hold.reserve(n);
    args.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      std::string where = method + " input " + std::to_string(i);
      auto tag = meta->input_tag(i);
      if (!tag.ok() || *tag != Tag::Tensor) fail(kIllegalArgument, where + " is not a tensor input; this bridge feeds tensors only");
      auto info = meta->input_tensor_meta(i);
      if (!info.ok()) fail(kIllegalState, where + ": no metadata (" + et_error(info.error()) + ")");
      auto want_sizes = info->sizes();
      if (kept[i] >= 0) {  // by reference to a kept output of `from`
        if (from == nullptr) fail(kIllegalArgument, where + " names a kept output but no method to take it from");
        if (static_cast<size_t>(kept[i]) >= from->outputs.size() || !from->outputs[kept[i]].isTensor())
          fail(kIllegalArgument, where + " names kept output " + std::to_string(kept[i]) + ", which does not exist");
        const auto& t = from->outputs[kept[i]].toTensor();
        if (t.scalar_type() != info->scalar_type() || t.dim() != static_cast<ssize_t>(want_sizes.size()) ||
            !std::equal(want_sizes.begin(), want_sizes.end(), t.sizes().begin()))
          fail(kIllegalArgument, where + " takes " + scalar_name(info->scalar_type()) + " " + shape_str(want_sizes) +
                                     ", the kept output is " + scalar_name(t.scalar_type()) + " " + shape_str(t.sizes()));
        args.emplace_back(from->outputs[kept[i]]);
        continue;
      }
      const DTypeInfo* dt = by_code(dtypes[i]);
      if (dt == nullptr) fail(kIllegalArgument, where + ": unknown dtype code " + std::to_string(dtypes[i]));
      if (dt->scalar != info->scalar_type())
        fail(kIllegalArgument, where + " is " + dt->name + ", the program takes " + scalar_name(info->scalar_type()));
      auto jshape = static_cast<jlongArray>(env->GetObjectArrayElement(inShape, static_cast<jsize>(i)));
      if (jshape == nullptr) fail(kIllegalArgument, where + ": no shape");
      std::vector<jlong> shape(static_cast<size_t>(env->GetArrayLength(jshape)));
      env->GetLongArrayRegion(jshape, 0, static_cast<jsize>(shape.size()), shape.data());
      env->DeleteLocalRef(jshape);
      if (shape.size() != want_sizes.size() || !std::equal(shape.begin(), shape.end(), want_sizes.begin()))
        fail(kIllegalArgument, where + " has shape " + shape_str(shape) + ", the program takes " + shape_str(want_sizes));
      size_t nbytes = info->nbytes();
      jobject data = env->GetObjectArrayElement(inData, static_cast<jsize>(i));
      if (data == nullptr) fail(kIllegalArgument, where + ": no data");
      std::vector<uint8_t>& buf = st.in_bufs[i];
      buf.resize(nbytes);  // same size every run: allocated once
      void* direct = env->GetDirectBufferAddress(data);
      if (direct != nullptr) {
        jlong cap = env->GetDirectBufferCapacity(data);
        if (static_cast<size_t>(cap) != nbytes)
          fail(kIllegalArgument, where + " has " + std::to_string(cap) + " bytes, " + dt->name + " " + shape_str(shape) +
                                     " needs " + std::to_string(nbytes));
        std::memcpy(buf.data(), direct, nbytes);  // the caller may reuse its buffer once run returns
      } else {
        jsize len = env->GetArrayLength(static_cast<jbyteArray>(data));
        if (static_cast<size_t>(len) != nbytes)
          fail(kIllegalArgument, where + " has " + std::to_string(len) + " bytes, " + dt->name + " " + shape_str(shape) +
                                     " needs " + std::to_string(nbytes));
        env->GetByteArrayRegion(static_cast<jbyteArray>(data), 0, len, reinterpret_cast<jbyte*>(buf.data()));
      }
      env->DeleteLocalRef(data);
      std::vector<executorch::aten::SizesType> sizes(want_sizes.begin(), want_sizes.end());
      hold.push_back(executorch::extension::from_blob(buf.data(), std::move(sizes), dt->scalar));
      args.emplace_back(hold.back());
    }
    // from here the previous outputs of `method` are overwritten, even if execute fails
    st.outputs.clear();
    ++st.generation;
    auto r = p->module->execute(method, args);
    if (!r.ok()) fail(kIllegalState, method + " failed (" + et_error(r.error()) + ")");
    st.outputs = std::move(*r);

    const size_t nout = st.outputs.size();
    std::vector<jboolean> keepv(nout, JNI_FALSE);
    if (keep != nullptr) {
      if (static_cast<size_t>(env->GetArrayLength(keep)) != nout)
        fail(kIllegalArgument, "keep has " + std::to_string(env->GetArrayLength(keep)) + " entries, " + method + " has " +
                                   std::to_string(nout) + " outputs");
      env->GetBooleanArrayRegion(keep, 0, static_cast<jsize>(nout), keepv.data());
    }
    jobjectArray out = env->NewObjectArray(static_cast<jsize>(1 + 2 * nout), env->FindClass("java/lang/Object"), nullptr);
    if (out == nullptr) fail("java/lang/OutOfMemoryError", "no room for " + method + "'s outputs");
    jlongArray gen = env->NewLongArray(1);
    jlong g = st.generation;
    env->SetLongArrayRegion(gen, 0, 1, &g);
    env->SetObjectArrayElement(out, 0, gen);
    env->DeleteLocalRef(gen);
    for (size_t i = 0; i < nout; ++i) {
      const EValue& v = st.outputs[i];
      if (!v.isTensor()) fail(kIllegalState, method + " output " + std::to_string(i) + " is not a tensor");
      const auto& t = v.toTensor();
      const DTypeInfo* dt = by_scalar(t.scalar_type());
      if (dt == nullptr) fail(kIllegalState, method + " output " + std::to_string(i) + " is " + scalar_name(t.scalar_type()) + ", which the wire protocol has no code for");
      std::vector<jlong> desc{dt->code};
      desc.insert(desc.end(), t.sizes().begin(), t.sizes().end());
      jlongArray jdesc = env->NewLongArray(static_cast<jsize>(desc.size()));
      if (jdesc == nullptr) fail("java/lang/OutOfMemoryError", "no room for " + method + "'s outputs");
      env->SetLongArrayRegion(jdesc, 0, static_cast<jsize>(desc.size()), desc.data());
      env->SetObjectArrayElement(out, static_cast<jsize>(1 + 2 * i), jdesc);
      env->DeleteLocalRef(jdesc);
      if (keepv[i]) continue;
      jbyteArray bytes = env->NewByteArray(static_cast<jsize>(t.nbytes()));
      if (bytes == nullptr) fail("java/lang/OutOfMemoryError", "no room for " + method + " output " + std::to_string(i));
      env->SetByteArrayRegion(bytes, 0, static_cast<jsize>(t.nbytes()), static_cast<const jbyte*>(t.const_data_ptr()));
      env->SetObjectArrayElement(out, static_cast<jsize>(2 + 2 * i), bytes);
      env->DeleteLocalRef(bytes);
    }
    return out;
  });
}

}  // extern "C"
