// TwoBitStatsRow: the stats' handover on the CPU. Each step's op copies its bucket's stats row
// (counters and summary, stats.ROW values) into a table in this library, keyed by the slot's
// number; stats.Slots.snapshot reads the rows through twobit_stats_rows (ctypes), with no
// TensorFlow call and no Python in the step. Built on first use by native_ops.py.
#include <mutex>
#include <unordered_map>
#include <vector>

#include "twobit_ops.h"

namespace twobit {

namespace {

struct Table {
  std::mutex mu;
  std::unordered_map<int64_t, std::vector<double>> rows;
};

Table& Rows() {
  static Table* table = new Table;  // never destroyed: steps may run while the process exits
  return *table;
}

}  // namespace

REGISTER_OP("TwoBitStatsRow")
    .Input("row: double")  // the slot's row at this step
    .Attr("key: int")      // the slot's number, unique in the process
    .Output("done: bool")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return tensorflow::OkStatus();
    });

class StatsRowOp : public OpKernel {
 public:
  explicit StatsRowOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
  }

  void Compute(OpKernelContext* ctx) override {
    const auto row = ctx->input(0).flat<double>();
    OP_REQUIRES(ctx, ctx->input(0).dims() == 1 && row.size() > 0,
                errors::InvalidArgument("a stats row is a non-empty vector"));
    Table& table = Rows();
    {
      std::lock_guard<std::mutex> lock(table.mu);
      table.rows[key_].assign(row.data(), row.data() + row.size());
    }
    Tensor* done = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &done));
    done->scalar<bool>()() = true;
  }

 private:
  int64_t key_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("TwoBitStatsRow").Device(tensorflow::DEVICE_CPU), StatsRowOp);

}  // namespace twobit

// The rows of keys[0..n) into out (n rows of width values, a row NaN where its slot has not
// stepped or its width differs); returns how many were found. Called through ctypes.
extern "C" __attribute__((visibility("default"))) int64_t twobit_stats_rows(
    const int64_t* keys, int64_t n, int64_t width, double* out) {
  twobit::Table& table = twobit::Rows();
  std::lock_guard<std::mutex> lock(table.mu);
  int64_t found = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto it = table.rows.find(keys[i]);
    double* dst = out + i * width;
    if (it == table.rows.end() || static_cast<int64_t>(it->second.size()) != width) {
      for (int64_t j = 0; j < width; ++j) dst[j] = __builtin_nan("");
      continue;
    }
    std::memcpy(dst, it->second.data(), width * sizeof(double));
    ++found;
  }
  return found;
}

// Forgets the rows of keys[0..n) (a compressor's slots when it is collected).
extern "C" __attribute__((visibility("default"))) void twobit_stats_forget(const int64_t* keys,
                                                                           int64_t n) {
  twobit::Table& table = twobit::Rows();
  std::lock_guard<std::mutex> lock(table.mu);
  for (int64_t i = 0; i < n; ++i) table.rows.erase(keys[i]);
}
