variable "region" {
  description = "AWS region of the job nodes, e.g. us-east-1. One module instance per region."
  type        = string
}

variable "name_prefix" {
  description = "Prefix of every resource name (VPC, security group, role, launch template)."
  type        = string
  default     = "fedbroker"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name_prefix))
    error_message = "name_prefix: 2-31 characters, lower-case letters, digits and '-', starting with a letter."
  }
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of the VPC. Private subnets are /20s carved from it (one per AZ), the NAT subnet is its last /24."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrnetmask(var.vpc_cidr)) && tonumber(split("/", var.vpc_cidr)[1]) <= 16
    error_message = "vpc_cidr must be an IPv4 CIDR of /16 or larger."
  }
}

variable "availability_zones" {
  description = "Availability zones of the private job-node subnets (at least 2), e.g. [\"us-east-1a\", \"us-east-1b\"]. Pick AZs that actually offer the GPU instance types you want."
  type        = list(string)

  validation {
    condition     = length(var.availability_zones) >= 2 && length(var.availability_zones) <= 15 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "availability_zones: give 2 to 15 distinct zones."
  }
}

variable "admin_cidr" {
  description = "CIDR allowed to SSH (tcp/22) into job nodes, e.g. a bastion or VPN range. null (the default) opens no SSH at all; use SSM Session Manager (enable_ssm) instead."
  type        = string
  default     = null

  validation {
    condition     = var.admin_cidr == null || (can(cidrnetmask(var.admin_cidr)) && var.admin_cidr != "0.0.0.0/0")
    error_message = "admin_cidr must be null or an IPv4 CIDR other than 0.0.0.0/0."
  }
}

variable "gpu_ami_id" {
  description = "AMI of the job nodes (an NVIDIA-driver GPU image, e.g. an AWS Deep Learning Base GPU AMI id, ami-...). null = look up the newest 'Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)' owned by Amazon in this region at plan time (see README)."
  type        = string
  default     = null

  validation {
    condition     = var.gpu_ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", var.gpu_ami_id))
    error_message = "gpu_ami_id must be null or an AMI id (ami-...)."
  }
}

variable "gpu_ami_name_filter" {
  description = "Name filter of the Amazon-owned AMI looked up when gpu_ami_id is null."
  type        = string
  default     = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
}

variable "root_volume_size_gb" {
  description = "Size of the encrypted gp3 root volume of each node, GiB (container images, datasets cache, local checkpoints)."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_size_gb >= 75 && var.root_volume_size_gb <= 16384
    error_message = "root_volume_size_gb must be between 75 (the DLAMI's own size) and 16384."
  }
}

variable "ebs_kms_key_arn" {
  description = "KMS key ARN encrypting the root volumes. null = the account's default EBS key (aws/ebs). Volumes are encrypted either way."
  type        = string
  default     = null
}

variable "enable_nat_gateway" {
  description = "Create one NAT gateway (in a small public subnet of the first AZ) so private nodes can pull container images and reach the broker over the internet. false = bring your own egress (VPN, Transit Gateway, VPC endpoints)."
  type        = bool
  default     = true
}

variable "broker_cidr_blocks" {
  description = "CIDRs of the broker's PostgreSQL and Redis that node agents connect to (e.g. the on-prem range over VPN). Empty = no such egress rule."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.broker_cidr_blocks : can(cidrnetmask(c))])
    error_message = "broker_cidr_blocks must be IPv4 CIDRs."
  }
}

variable "broker_ports" {
  description = "TCP ports node agents open to broker_cidr_blocks (PostgreSQL job store, Redis)."
  type        = list(number)
  default     = [5432, 6379]
}

variable "enable_ssm" {
  description = "Attach AmazonSSMManagedInstanceCore to the node role, for Session Manager shell access without SSH."
  type        = bool
  default     = false
}

variable "ecr_repository_arns" {
  description = "ECR repository ARNs the nodes may pull job images from (read-only). Empty = no ECR permissions (public registries need none)."
  type        = list(string)
  default     = []
}

variable "checkpoint_bucket_arn" {
  description = "S3 bucket ARN (arn:aws:s3:::NAME) where jobs write checkpoints. null = no S3 permissions. Access is limited to checkpoint_prefix."
  type        = string
  default     = null
}

variable "checkpoint_prefix" {
  description = "Key prefix inside checkpoint_bucket_arn that nodes may read, write and delete (e.g. fedbroker/)."
  type        = string
  default     = "fedbroker/"
}

variable "tags" {
  description = "Tags added to every resource (default_tags of the provider)."
  type        = map(string)
  default     = {}
}
