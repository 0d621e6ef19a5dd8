variable "project" {
  description = "GCP project id that holds the job nodes."
  type        = string
}

variable "region" {
  description = "GCP region of the job nodes' subnetwork, e.g. us-central1. One module instance per region."
  type        = string
}

variable "name_prefix" {
  description = "Prefix of every resource name (network, subnetwork, firewall rules, service account, template)."
  type        = string
  default     = "fedbroker"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,19}$", var.name_prefix))
    error_message = "name_prefix: 2-20 characters, lower-case letters, digits and '-', starting with a letter (service account ids are at most 30 characters)."
  }
}

variable "subnet_cidr" {
  description = "Primary IPv4 range of the job-node subnetwork."
  type        = string
  default     = "10.43.0.0/20"

  validation {
    condition     = can(cidrnetmask(var.subnet_cidr))
    error_message = "subnet_cidr must be an IPv4 CIDR."
  }
}

variable "admin_cidr" {
  description = "CIDR allowed to SSH (tcp/22) into job nodes, e.g. a bastion, VPN or IAP range (35.235.240.0/20). null (the default) creates no SSH rule."
  type        = string
  default     = null

  validation {
    condition     = var.admin_cidr == null || (can(cidrnetmask(var.admin_cidr)) && var.admin_cidr != "0.0.0.0/0")
    error_message = "admin_cidr must be null or an IPv4 CIDR other than 0.0.0.0/0."
  }
}

variable "gpu_image" {
  description = "Boot image of the job nodes: an image or image family URL with NVIDIA drivers, by default the Deep Learning VM 'common' CUDA family (see README for how to list current families)."
  type        = string
  default     = "projects/deeplearning-platform-release/global/images/family/common-cu121-debian-11"
}

variable "machine_type" {
  description = "Machine type of the instance template. The broker overrides it per offer when it creates instances; A2/A3/G2 types carry their GPUs built in."
  type        = string
  default     = "a2-highgpu-1g"
}

variable "boot_disk_size_gb" {
  description = "Boot disk size of each node, GB (the Deep Learning VM images need at least 50)."
  type        = number
  default     = 200

  validation {
    condition     = var.boot_disk_size_gb >= 50
    error_message = "boot_disk_size_gb must be at least 50."
  }
}

variable "boot_disk_type" {
  description = "Boot disk type (pd-balanced, pd-ssd; hyperdisk-balanced for A3 Mega/Ultra)."
  type        = string
  default     = "pd-balanced"
}

variable "enable_secure_boot" {
  description = "Shielded VM Secure Boot. Off by default: the Deep Learning VM images install NVIDIA kernel modules that are not signed for Secure Boot, so the GPU driver would not load. vTPM and integrity monitoring stay on."
  type        = bool
  default     = false
}

variable "enable_nat" {
  description = "Create a Cloud Router + Cloud NAT so nodes without external IPs can pull images from public registries and reach the broker. false = bring your own egress (VPN, Interconnect)."
  type        = bool
  default     = true
}

variable "checkpoint_bucket" {
  description = "Cloud Storage bucket name where jobs write checkpoints. null = no storage permissions. The grant is on this bucket only (roles/storage.objectUser)."
  type        = string
  default     = null
}

variable "artifact_registry_repositories" {
  description = "Artifact Registry repositories the nodes may pull job images from, as projects/P/locations/L/repositories/R. Empty = none (public registries need none)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for r in var.artifact_registry_repositories : can(regex("^projects/[^/]+/locations/[^/]+/repositories/[^/]+$", r))])
    error_message = "artifact_registry_repositories: each entry must be projects/P/locations/L/repositories/R."
  }
}

variable "labels" {
  description = "Labels added to the instance template (and so to each node)."
  type        = map(string)
  default     = {}
}
