// Registry of custom-op descriptors (op_plugins/<op>/spec.json): what each op accepts, checked
// once at registration so every later consumer can trust it.
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
  std::string type;  // int float bool str int_list float_list
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

  // Validates and stores `op`. Throws std::invalid_argument naming the op, the field, what was
  // expected and what came. Registering an identical descriptor again is a no-op; a different
  // descriptor under a taken name is an error.
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

// Throws std::invalid_argument if `op` breaks a rule of the descriptor format.
void validate_op_descriptor(const OpDescriptor& op);

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_OP_REGISTRY_H_
