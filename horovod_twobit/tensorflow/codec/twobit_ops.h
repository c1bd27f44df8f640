// What the codec's CPU ops (segment_levels.cc, bucket_encode.cc, bucket_finish.cc) share: the
// TensorFlow names they use, GCC/Clang vector types, and an AVX2 clone of their loops on x86-64.
#ifndef HOROVOD_TWOBIT_TWOBIT_OPS_H_
#define HOROVOD_TWOBIT_TWOBIT_OPS_H_

#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace twobit {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
namespace errors = tensorflow::errors;

constexpr int kValuesPerWord = 16;  // wire.VALUES_PER_WORD
constexpr int kHeaderWords = 8;     // wire.BUCKET_HEADER_WORDS: the members' flag bytes follow

typedef double V4d __attribute__((vector_size(32)));
typedef int64_t V4i __attribute__((vector_size(32)));
typedef float V4f __attribute__((vector_size(16)));
typedef float V8f __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));
typedef uint32_t V8u __attribute__((vector_size(32)));

#if defined(__x86_64__)
#define TWOBIT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TWOBIT_CLONES
#endif

// Whether a bucket's layout fits its payload, else the op fails with the reason: the members'
// (and, "auto", the segments') words add up to the bucket's, one threshold and one magnitude (or
// one of each per segment), the members' flag bytes end before the magnitudes, and those before
// the body.
inline bool LayoutFits(OpKernelContext* ctx, const Tensor& member_words, const Tensor& seg_words,
                       const Tensor& ts, const Tensor& vs, int64_t nwords, int64_t mags_at,
                       int64_t body_at) {
  const auto members = member_words.flat<int64_t>();
  const auto segs = seg_words.flat<int64_t>();
  const int64_t levels = segs.size() > 0 ? segs.size() : 1;
  int64_t total = 0, seg_total = 0;
  for (int64_t m = 0; m < members.size(); ++m) total += members(m);
  for (int64_t s = 0; s < segs.size(); ++s) seg_total += segs(s);
  if (total != nwords || (segs.size() > 0 && seg_total != nwords)) {
    ctx->CtxFailure(errors::InvalidArgument("members' (and segments') words must add up to ",
                                            nwords));
  } else if (ts.NumElements() != levels || vs.NumElements() != levels) {
    ctx->CtxFailure(errors::InvalidArgument("one threshold and magnitude, or one per segment"));
  } else if (kHeaderWords + (members.size() + 3) / 4 > mags_at ||
             mags_at + (segs.size() > 0 ? levels : 0) > body_at) {
    ctx->CtxFailure(errors::InvalidArgument("the flags and magnitudes overrun the body"));
  } else {
    return true;
  }
  return false;
}

// Calls run(member, first word, words, segment) for every run of a member's words that lies in
// one segment, member by member (segments of no words skipped). Without segments (a numeric
// threshold) a member is one run of segment 0. LayoutFits has checked that both add up.
template <typename Run>
inline void ForEachRun(const Tensor& member_words, const Tensor& seg_words, int64_t nwords,
                       Run run) {
  const auto members = member_words.flat<int64_t>();
  const auto segs = seg_words.flat<int64_t>();
  int64_t w = 0, seg = 0, seg_left = segs.size() > 0 ? segs(0) : nwords;
  for (int64_t m = 0; m < members.size(); ++m) {
    for (int64_t left = members(m); left > 0;) {
      while (seg_left == 0) seg_left = segs(++seg);
      const int64_t n = left < seg_left ? left : seg_left;
      run(m, w, n, seg);
      w += n;
      left -= n;
      seg_left -= n;
    }
  }
}

}  // namespace twobit

#endif  // HOROVOD_TWOBIT_TWOBIT_OPS_H_
