// TwoBitBucketEncode: a bucket's payload on the CPU, the bits of bucket_passes.encode_body: the
// codes of x = b + g against each segment's threshold (or the one threshold), packed 16 to a word
// in MXNet's layout, each member's NaN/Inf flag byte (from its gradient), the header with the
// non-finite flag, and the "auto" magnitudes. One pass over the bucket, 8 values at a time. Built
// on first use by native_ops.py, without -ffast-math and with -ffp-contract=off.

#include "twobit_ops.h"

namespace twobit {

constexpr int32_t kFlagNonfinite = 1;  // wire.FLAG_NONFINITE, in header word 1

REGISTER_OP("TwoBitBucketEncode")
    .Input("g: float")             // the flat gradient (words * 16 values)
    .Input("b: float")             // the flat residual
    .Input("thresholds: float")    // one (a fixed threshold) or one per segment ("auto")
    .Input("magnitudes: float")    // one per segment ("auto", written to the payload), or none
    .Input("member_words: int64")  // words per member, in order
    .Input("seg_words: int64")     // words per segment, in order ("auto"; else empty)
    .Input("head: int32")          // the static header words
    .Attr("mags_at: int")          // the payload word of the first segment's magnitude
    .Attr("body_at: int")          // the payload's first packed word
    .Output("payload: int32")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int body_at = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("body_at", &body_at));
      const int64_t n = c->Value(c->NumElements(c->input(0)));  // body_at + n / 16 words
      c->set_output(0, c->Vector(n == tensorflow::shape_inference::InferenceContext::kUnknownDim
                                     ? c->UnknownDim()
                                     : c->MakeDim(body_at + n / kValuesPerWord)));
      return tensorflow::OkStatus();
    });

// One run of words under one threshold t: their packed words; returns whether any g is NaN or
// infinite. Code 3 (11) where x >= t, 2 (10) where x <= -t, else 0; value k of a word goes to
// that byte's bits 7-6, 5-4, 3-2, 1-0 (wire.WORD_SHIFTS).
TWOBIT_CLONES static bool EncodeRun(const float* g, const float* b, int64_t nwords, float t,
                                    int32_t* out) {
  const V8i shifts[2] = {{6, 4, 2, 0, 14, 12, 10, 8}, {22, 20, 18, 16, 30, 28, 26, 24}};
  const V8f tv = {t, t, t, t, t, t, t, t};
  const V8f neg_t = -tv;
  const V8i exponent = {0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000,
                        0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000};
  V8i nonfinite = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t w = 0; w < nwords; ++w) {
    V8i packed = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int h = 0; h < 2; ++h) {
      V8f gv, bv;
      std::memcpy(&gv, g + w * kValuesPerWord + 8 * h, sizeof gv);
      std::memcpy(&bv, b + w * kValuesPerWord + 8 * h, sizeof bv);
      const V8f x = bv + gv;
      // a comparison is -1 where true: 3 where x >= t, 2 where x <= -t
      const V8i code = ((x >= tv) & 3) | ((x <= neg_t) & 2);
      packed |= code << shifts[h];
      nonfinite |= ((V8i)gv & exponent) == exponent;
    }
    int32_t word = 0;
    for (int l = 0; l < 8; ++l) word |= packed[l];
    out[w] = word;
  }
  int32_t any = 0;
  for (int l = 0; l < 8; ++l) any |= nonfinite[l];
  return any != 0;
}

class BucketEncodeOp : public OpKernel {
 public:
  explicit BucketEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mags_at", &mags_at_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("body_at", &body_at_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& b = ctx->input(1);
    const auto ts = ctx->input(2).flat<float>();
    const auto vs = ctx->input(3).flat<float>();
    const auto head = ctx->input(6).flat<int32_t>();
    const int64_t nvalues = g.NumElements();
    OP_REQUIRES(ctx, b.NumElements() == nvalues && nvalues % kValuesPerWord == 0,
                errors::InvalidArgument("g and b must hold the same whole words"));
    OP_REQUIRES(ctx, head.size() == kHeaderWords,
                errors::InvalidArgument("head must hold ", kHeaderWords, " words"));
    const int64_t nwords = nvalues / kValuesPerWord;
    const bool autolevels = ctx->input(5).NumElements() > 0;
    if (!LayoutFits(ctx, ctx->input(4), ctx->input(5), ctx->input(2), ctx->input(3), nwords,
                    mags_at_, body_at_)) {
      return;
    }
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({body_at_ + nwords}), &out_t));
    int32_t* payload = out_t->flat<int32_t>().data();
    std::memset(payload, 0, sizeof(int32_t) * body_at_);
    for (int k = 0; k < kHeaderWords; ++k) payload[k] = head(k);
    if (autolevels) std::memcpy(payload + mags_at_, vs.data(), sizeof(float) * vs.size());
    uint8_t* flags = reinterpret_cast<uint8_t*>(payload + kHeaderWords);
    const float* gp = g.flat<float>().data();
    const float* bp = b.flat<float>().data();
    int32_t* words = payload + body_at_;
    bool any_bad = false;
    ForEachRun(ctx->input(4), ctx->input(5), nwords, [&](int64_t m, int64_t w, int64_t n,
                                                         int64_t seg) {
      const int64_t at = w * kValuesPerWord;
      if (EncodeRun(gp + at, bp + at, n, ts(seg), words + w)) flags[m] = 1;  // 0 from the memset
      any_bad = any_bad || flags[m];
    });
    if (any_bad) payload[1] |= kFlagNonfinite;
  }

 private:
  int mags_at_ = 0;
  int body_at_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("TwoBitBucketEncode").Device(tensorflow::DEVICE_CPU),
                        BucketEncodeOp);

}  // namespace twobit
