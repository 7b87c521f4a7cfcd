#include "op_registry.h"

#include <stdexcept>

namespace ascend_vlm {
namespace {

std::string quoted(const std::string& text) { return "'" + text + "'"; }

[[noreturn]] void reject(const OpDescriptor& op, const std::string& field,
                         const std::string& problem) {
  throw std::invalid_argument("op " + quoted(op.name) + ": " + field + ": " + problem);
}

}  // namespace

bool TensorSpec::operator==(const TensorSpec& other) const {
  return name == other.name && dtypes == other.dtypes && formats == other.formats &&
         rank == other.rank && dynamic_dims == other.dynamic_dims &&
         all_dims_dynamic == other.all_dims_dynamic && optional == other.optional;
}

bool AttrSpec::operator==(const AttrSpec& other) const {
  return name == other.name && type == other.type && default_value == other.default_value;
}

bool OpDescriptor::operator==(const OpDescriptor& other) const {
  return name == other.name && summary == other.summary && npu_kernel == other.npu_kernel &&
         inputs == other.inputs && outputs == other.outputs && attrs == other.attrs;
}

OpRegistry& OpRegistry::global() {
  static OpRegistry* registry = new OpRegistry();
  return *registry;
}

void OpRegistry::add(const OpDescriptor& op) {
  std::lock_guard lock(mutex_);
  auto [it, inserted] = ops_.emplace(op.name, op);
  if (!inserted && !(it->second == op)) {
    reject(op, "name", "already registered with a different descriptor; unregister it first");
  }
}

bool OpRegistry::remove(const std::string& name) {
  std::lock_guard lock(mutex_);
  return ops_.erase(name) == 1;
}

std::optional<OpDescriptor> OpRegistry::find(const std::string& name) const {
  std::lock_guard lock(mutex_);
  auto it = ops_.find(name);
  if (it == ops_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> OpRegistry::names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [name, op] : ops_) out.push_back(name);
  return out;
}

}  // namespace ascend_vlm
