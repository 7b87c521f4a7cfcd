// Registry of custom-op descriptors (op_plugins/<op>/spec.json): what each op accepts. The
// descriptor format has one validator, in Python (ascend_vlm/_op_descriptor.py): the ops must load
// their specs without this extension, and ascend_vlm.runtime.register_op checks every descriptor
// there before it reaches this registry.
#ifndef ASCEND_VLM_RUNTIME_OP_REGISTRY_H_
#define ASCEND_VLM_RUNTIME_OP_REGISTRY_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace ascend_vlm {

struct TensorSpec {
  std::string name;
  std::vector<std::string> dtypes;
  std::vector<std::string> formats;
  int64_t rank = -1;                  // -1: any rank
  std::vector<int64_t> dynamic_dims;  // axes in [0, rank) whose size may vary (>= 0 if rank -1)
  bool all_dims_dynamic = false;      // "dynamic_dims": "all"
  bool optional = false;
  bool operator==(const TensorSpec& other) const;
};

using AttrValue =
    std::variant<bool, int64_t, double, std::string, std::vector<int64_t>, std::vector<double>>;

struct AttrSpec {
  std::string name;
  std::string type;  // an attr type of ascend_vlm/_op_descriptor.py (int, float, ...)
  std::optional<AttrValue> default_value;
  bool operator==(const AttrSpec& other) const;
};

struct OpDescriptor {
  std::string name;
  std::string summary;
  std::string npu_kernel;
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  std::vector<AttrSpec> attrs;
  bool operator==(const OpDescriptor& other) const;
};

class OpRegistry {
 public:
  static OpRegistry& global();

  // Stores `op` (already validated). Registering an identical descriptor again is a no-op; a
  // different descriptor under a taken name throws std::invalid_argument naming the op.
  void add(const OpDescriptor& op);
  // False if no op has that name.
  bool remove(const std::string& name);
  std::optional<OpDescriptor> find(const std::string& name) const;
  // Registered names, sorted.
  std::vector<std::string> names() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, OpDescriptor> ops_;
};

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_OP_REGISTRY_H_
