#include <ATen/ATen.h>
#include <sys/stat.h>

#include <string>

#include "lockstep/data.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

// Fashion-MNIST's training-set pixel statistics, after scaling to [0, 1].
constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// "<dir>/<stem>.gz" if present, else "<dir>/<stem>".
std::string FindFile(const std::string& dir, const std::string& stem) {
  const std::string base = dir + "/" + stem;
  if (Exists(base + ".gz")) return base + ".gz";
  if (Exists(base)) return base;
  throw DataError("Fashion-MNIST file '" + base + ".gz' not found (is the Debian package "
                  "dataset-fashion-mnist installed, or data.dir set?)");
}

}  // namespace

Batch TensorDataset::Gather(const at::Tensor& indices) const {
  return Batch{inputs.index_select(0, indices), targets.index_select(0, indices), at::Tensor()};
}

TensorDataset LoadFashionMnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const std::string images_path = FindFile(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = FindFile(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = ReadIdxFile(images_path);
  at::Tensor labels = ReadIdxFile(labels_path);
  if (images.dim() != 3 || images.scalar_type() != at::kByte) {
    throw DataError("'" + images_path + "' is not a uint8 [N, H, W] image file");
  }
  if (labels.dim() != 1 || labels.size(0) != images.size(0)) {
    throw DataError("'" + labels_path + "' does not hold one label per image of '" + images_path + "'");
  }
  TensorDataset dataset;
  dataset.inputs = images.unsqueeze(1).to(at::kFloat).div_(255.0).sub_(kFashionMnistMean).div_(kFashionMnistStd);
  dataset.targets = labels.to(at::kLong);
  return dataset;
}

TensorDataset MakeSyntheticDataset(const SyntheticOptions& o) {
  if (o.num_examples <= 0 || o.channels <= 0 || o.height <= 0 || o.width <= 0 || o.num_classes <= 1) {
    throw InvalidArgumentError("synthetic dataset needs positive sizes and at least two classes");
  }
  at::Generator data_gen = at::detail::createCPUGenerator(o.seed);
  at::Generator teacher_gen = at::detail::createCPUGenerator(o.teacher_seed + 0x9E3779B97F4A7C15ULL);
  const int64_t features = o.channels * o.height * o.width;
  TensorDataset dataset;
  dataset.inputs = at::randn({o.num_examples, o.channels, o.height, o.width}, data_gen, at::kFloat);
  const at::Tensor teacher = at::randn({features, o.num_classes}, teacher_gen, at::kFloat);
  dataset.targets = dataset.inputs.reshape({o.num_examples, features}).matmul(teacher).argmax(1);
  return dataset;
}

}  // namespace lockstep
