// TwoBitBucketFinish: a bucket's finish on the CPU, the bits of bucket_passes.finish_body: every
// rank's payload decoded and summed in rank order, NaN for a member flagged on any rank (or for
// every member when the headers disagree), the division of an average and the scale, and the
// error-feedback commit of this rank's residual; when asked, the new residual's norms for the
// stats. One pass over the bucket's words, 16 values at a time, the norms included. Built on
// first use by native_ops.py, without -ffast-math and with -ffp-contract=off.
#include <limits>
#include <vector>

#include "twobit_ops.h"

namespace twobit {

REGISTER_OP("TwoBitBucketFinish")
    .Input("rows: int32")          // (nranks, payload words): every rank's payload
    .Input("checked: bool")        // the headers agree
    .Input("count: float")         // an average's divisor
    .Input("g: float")             // this rank's flat gradient (words * 16)
    .Input("before: float")        // its flat residual before the step
    .Input("thresholds: float")    // one (a fixed threshold) or one per segment ("auto")
    .Input("magnitudes: float")    // likewise
    .Input("member_words: int64")  // words per member, in order
    .Input("seg_words: int64")     // words per segment, in order ("auto"; else empty)
    .Input("want_norms: bool")     // whether to compute the new residual's norms
    .Attr("mags_at: int")          // the payload word of the first segment's magnitude
    .Attr("body_at: int")          // the payload's first packed word
    .Attr("average: bool")
    .Attr("scale: float")
    .Output("out: float")
    .Output("new_residual: float")
    .Output("bad: bool")
    .Output("norms: double")       // its sum of squares and max |r|, NaN unless wanted
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(3));
      c->set_output(1, c->input(3));
      c->set_output(2, c->Scalar());
      c->set_output(3, c->Vector(2));
      return tensorflow::OkStatus();
    });

static inline V8f Load(const float* p) {
  V8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void Store(float* p, V8f v) { std::memcpy(p, &v, sizeof v); }

static inline V8f Splat(float x) { return V8f{x, x, x, x, x, x, x, x}; }

// The stats' norms of a new residual, gathered while the finish writes it (codec.norms): per
// lane, float64 sums of float32 sums of squares over kNormWords words (at most 8 squares each:
// a relative error under 5e-7), and the largest |r|.
constexpr int64_t kNormWords = 4;

struct NormSums {
  V4d sq[2] = {{0.0, 0.0, 0.0, 0.0}, {0.0, 0.0, 0.0, 0.0}};
  V8f top = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
};

// One run of words that share this rank's levels (t, v) and each sender's magnitude mags[i].
// Value k of a word is that byte's bits 7-6, 5-4, 3-2, 1-0 (wire.WORD_SHIFTS); each value is
// decoded as codec.decoded does (the sign, the low bit, times the magnitude where the high bit
// is set) and the ranks' values added in rank order; every branch is a vector select. With
// sums, the new residual's norms too, from the values as they are stored: no second pass.
TWOBIT_CLONES static void FinishRun(const int32_t* const* words, int nranks, const float* mags,
                                    int64_t nwords, bool bad, float count, bool average,
                                    float scale, float t, float v, const float* g,
                                    const float* before, float* out, float* fresh,
                                    NormSums* sums) {
  const V8u shifts[2] = {{6, 4, 2, 0, 14, 12, 10, 8}, {22, 20, 18, 16, 30, 28, 26, 24}};
  const V8f zero = Splat(0.0f), nan = Splat(std::numeric_limits<float>::quiet_NaN());
  const V8f tv = Splat(t), vv = Splat(v), neg_t = Splat(-t), countv = Splat(count);
  const V8f scalev = Splat(scale);
  V4d sq[2] = {{0.0, 0.0, 0.0, 0.0}, {0.0, 0.0, 0.0, 0.0}};
  V8f top = zero, block = zero;
  for (int64_t w = 0; w < nwords; ++w) {
    const int64_t at = w * kValuesPerWord;
    V8f kept[2];
    for (int h = 0; h < 2; ++h) {
      V8f acc = zero;
      for (int i = 0; i < nranks; ++i) {
        const uint32_t word = static_cast<uint32_t>(words[i][w]);
        const V8i c = (V8i)((V8u{word, word, word, word, word, word, word, word} >> shifts[h]) &
                            3u);
        const V8f sign = __builtin_convertvector((c & 1) * 2 - 1, V8f);
        const V8f val = c >= 2 ? sign * Splat(mags[i]) : zero;
        acc = i == 0 ? val : acc + val;
      }
      V8f o = bad ? nan : acc;
      if (average) o = o / countv;
      if (scale != 1.0f) o = o * scalev;
      Store(out + at + 8 * h, o);
      const V8f b = Load(before + at + 8 * h);
      const V8f x = b + Load(g + at + 8 * h);
      const V8f r = x >= tv ? x - vv : (x <= neg_t ? x + vv : x);
      kept[h] = bad ? b : r;
      Store(fresh + at + 8 * h, kept[h]);
    }
    if (sums != nullptr) {  // NaN stays out of the max (comparisons), not out of the sum
      const V8f a0 = (V8f)((V8i)kept[0] & 0x7fffffff), a1 = (V8f)((V8i)kept[1] & 0x7fffffff);
      const V8f most = a0 > a1 ? a0 : a1;
      top = most > top ? most : top;
      block += kept[0] * kept[0] + kept[1] * kept[1];
      if (w % kNormWords == kNormWords - 1 || w == nwords - 1) {
        sq[0] += __builtin_convertvector((V4f){block[0], block[1], block[2], block[3]}, V4d);
        sq[1] += __builtin_convertvector((V4f){block[4], block[5], block[6], block[7]}, V4d);
        block = zero;
      }
    }
  }
  if (sums != nullptr) {
    sums->sq[0] += sq[0];
    sums->sq[1] += sq[1];
    sums->top = top > sums->top ? top : sums->top;
  }
}

class BucketFinishOp : public OpKernel {
 public:
  explicit BucketFinishOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mags_at", &mags_at_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("body_at", &body_at_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("average", &average_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    const bool checked = ctx->input(1).scalar<bool>()();
    const float count = ctx->input(2).scalar<float>()();
    const Tensor& g = ctx->input(3);
    const Tensor& before = ctx->input(4);
    const auto ts = ctx->input(5).flat<float>();
    const auto vs = ctx->input(6).flat<float>();
    OP_REQUIRES(ctx, rows.dims() == 2, errors::InvalidArgument("rows must be 2-D"));
    const int nranks = static_cast<int>(rows.dim_size(0));
    const int64_t width = rows.dim_size(1);
    const int64_t nvalues = g.NumElements();
    OP_REQUIRES(ctx, nranks >= 1, errors::InvalidArgument("no rows"));
    OP_REQUIRES(ctx, before.NumElements() == nvalues && nvalues % kValuesPerWord == 0,
                errors::InvalidArgument("g and before must hold the same whole words"));
    const int64_t nwords = nvalues / kValuesPerWord;
    OP_REQUIRES(ctx, body_at_ + nwords == width,
                errors::InvalidArgument("rows of ", width, " words do not fit ", nwords,
                                        " packed words after ", body_at_));
    const bool autolevels = ctx->input(8).NumElements() > 0;
    if (!LayoutFits(ctx, ctx->input(7), ctx->input(8), ctx->input(5), ctx->input(6), nwords,
                    mags_at_, body_at_)) {
      return;
    }
    Tensor* out_t = nullptr;
    Tensor* new_t = nullptr;
    Tensor* bad_t = nullptr;
    Tensor* norms_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, g.shape(), &out_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, g.shape(), &new_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &bad_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({2}), &norms_t));
    const int32_t* base = rows.flat<int32_t>().data();
    const float* gp = g.flat<float>().data();
    const float* bp = before.flat<float>().data();
    float* op = out_t->flat<float>().data();
    float* np = new_t->flat<float>().data();
    std::vector<const int32_t*> words(nranks);
    std::vector<float> mags(nranks);
    std::vector<bool> member_bad(ctx->input(7).NumElements());
    bool any_bad = false;
    const bool want = ctx->input(9).scalar<bool>()();
    NormSums sums;
    for (size_t m = 0; m < member_bad.size(); ++m) {
      bool bad = !checked;  // a member flagged by any rank is NaN everywhere
      for (int i = 0; i < nranks; ++i) {
        const uint8_t* flags = reinterpret_cast<const uint8_t*>(base + i * width + kHeaderWords);
        bad = bad || flags[m] != 0;
      }
      member_bad[m] = bad;
      any_bad = any_bad || bad;
    }
    ForEachRun(ctx->input(7), ctx->input(8), nwords, [&](int64_t m, int64_t w, int64_t n,
                                                         int64_t seg) {
      for (int i = 0; i < nranks; ++i) {
        const int32_t* row = base + i * width;
        words[i] = row + body_at_ + w;
        if (autolevels) {
          std::memcpy(&mags[i], row + mags_at_ + seg, sizeof(float));
        } else {
          mags[i] = ts(0);
        }
      }
      const int64_t at = w * kValuesPerWord;
      FinishRun(words.data(), nranks, mags.data(), n, member_bad[m], count, average_, scale_,
                ts(seg), vs(seg), gp + at, bp + at, op + at, np + at, want ? &sums : nullptr);
    });
    bad_t->scalar<bool>()() = any_bad;
    auto norms = norms_t->flat<double>();
    norms(0) = norms(1) = std::numeric_limits<double>::quiet_NaN();
    if (want) {
      double total = 0.0;
      float most = 0.0f;
      for (int l = 0; l < 4; ++l) total += sums.sq[0][l] + sums.sq[1][l];
      for (int l = 0; l < 8; ++l) most = sums.top[l] > most ? sums.top[l] : most;
      norms(0) = total;
      norms(1) = most;
    }
  }

 private:
  int mags_at_ = 0;
  int body_at_ = 0;
  bool average_ = false;
  float scale_ = 1.0f;
};

REGISTER_KERNEL_BUILDER(Name("TwoBitBucketFinish").Device(tensorflow::DEVICE_CPU),
                        BucketFinishOp);

}  // namespace twobit
